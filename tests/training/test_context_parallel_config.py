"""--context-parallel-size and --cp-comm-type on the command line: the layout they make and the
combinations refused (each a ConfigError that starts with the flag to change); the document
flags, which run under cp."""

import shlex

import pytest

from megadyn.training.arguments import ConfigError, parse_args
from tests.tiny import tiny_args

BASE = shlex.join(
    tiny_args(
        num_layers=4,
        max_position_embeddings=None,
        global_batch_size=None,  # Megatron's default: micro batch x dp
        train_iters=2,
        attention_dropout=0,
    )
)


def parse(extra: str, world_size: int):
    return parse_args(shlex.split(f"{BASE} {extra}"), world_size)


def test_cp_is_a_layout_dimension():
    cfg = parse(
        "--context-parallel-size 2 --tensor-model-parallel-size 2 --cp-comm-type all_gather", 8
    )
    layout = cfg.layout(8)
    assert (layout.tp, layout.cp, layout.dp, layout.pp) == (2, 2, 2, 1)
    assert cfg.model.cp_comm_type == "all_gather"
    assert cfg.training.global_batch_size == 2  # Megatron's default: micro batch x dp
    cfg = parse(
        "--context-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel "
        "--tensor-model-parallel-size 2",
        8,
    )
    assert (cfg.layout(8).cp, cfg.layout(8).pp, cfg.layout(8).dp) == (2, 2, 1)
    cfg = parse("--context-parallel-size 4 --cp-comm-type a2a", 4)  # 4 heads over cp 4
    assert cfg.model.cp_comm_type == "a2a" and cfg.layout(4).cp == 4


def test_document_flags_reach_the_config_and_run_under_cp():
    cfg = parse(
        "--context-parallel-size 2 --cp-comm-type all_gather --reset-position-ids "
        "--reset-attention-mask --eod-mask-loss",
        4,
    )
    assert cfg.model.reset_position_ids and cfg.data.reset_attention_mask
    assert cfg.data.eod_mask_loss and cfg.layout(4).cp == 2
    plain = parse("", 1)
    assert not (plain.model.reset_position_ids or plain.data.reset_attention_mask)
    assert not plain.data.eod_mask_loss


@pytest.mark.parametrize(
    "extra, world_size, flag",
    [
        ("--context-parallel-size 3", 6, "--seq-length"),  # 16 is not 2 x 3 chunks
        ("--context-parallel-size 2 --tensor-model-parallel-size 4 --sequence-parallel "
         "--seq-length 24", 8, "--seq-length"),  # 24 % (2 x 2 x 4)
        ("--context-parallel-size 2 --enable-cuda-graph --hidden-dropout 0", 2,
         "--context-parallel-size"),
        ("--context-parallel-size 0", 2, "--context-parallel-size"),
        ("--cp-comm-type all_gather", 2, "--cp-comm-type"),
        ("--context-parallel-size 2 --cp-comm-type ulysses", 2, "--cp-comm-type"),
        ("--context-parallel-size 4 --tensor-model-parallel-size 2 --cp-comm-type a2a", 8,
         "--cp-comm-type"),  # 2 key/value heads per tp rank over cp 4
        ("--context-parallel-size 2 --cp-comm-type a2a --attention-dropout 0.1", 2,
         "--cp-comm-type"),
        ("--context-parallel-size 2 --cp-placement dynamic --cp-block-size 4 "
         "--cp-comm-type a2a", 2, "--cp-comm-type"),
        ("--cp-placement dynamic", 2, "--cp-placement"),
        ("--context-parallel-size 2 --cp-placement dynamic --cp-block-size 3", 2,
         "--cp-block-size"),
        ("--context-parallel-size 2 --cp-placement dynamic --cp-block-size 4 "
         "--cp-comm-type all_gather", 2, "--cp-comm-type"),
        ("--context-parallel-size 2 --cp-placement dynamic --cp-block-size 4 "
         "--attention-dropout 0.1", 2, "--cp-placement"),
        ("--reset-attention-mask --attention-dropout 0.1", 1, "--reset-attention-mask"),
        ("--reset-attention-mask --enable-cuda-graph --hidden-dropout 0", 1,
         "--reset-attention-mask"),
    ],
)  # fmt: skip
def test_cp_refusals_name_their_flags(extra, world_size, flag):
    with pytest.raises(ConfigError) as err:
        parse(extra, world_size)
    assert str(err.value).startswith(flag), str(err.value)
    for named in ("--attention-dropout", "--enable-cuda-graph"):
        if named in extra and flag != named:
            assert named in str(err.value), str(err.value)
