"""Offline layout change: a checked copy of a layout-free checkpoint; the copy resumes training
under the target layout exactly as the original does. Also the printed pretrain_gpt.py flags."""

import json
import os

import pytest
from convert_helpers import TRAIN, tool, train

from megadyn.convert import ConversionError
from megadyn.convert.layouts import Target, check_layout, model_flags
from megadyn.models.config import GPTConfig


def relayout_args(load, save, *extra):
    return ["--loader", "megadyn", "--saver", "megadyn", "--load-dir", load, "--save-dir", save,
            "--no-progress", *extra]  # fmt: skip


def test_relayout_copy_resumes_under_target_layout(trained, tmp_path):
    save, losses = trained
    target = ["--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "2",
              "--use-distributed-optimizer"]  # fmt: skip
    out = str(tmp_path / "pp2")
    tool("convert_checkpoint").main(relayout_args(os.path.join(save, "iter_0000003"), out, *target))
    meta = json.loads(open(os.path.join(out, "iter_0000003", "megadyn.json")).read())
    assert meta["layout"]["pp"] == 2 and meta["layout"]["tp"] == 1
    assert meta["args"]["parallel.pp"] == 2 and meta["args"]["optimizer.use_distributed_optimizer"]
    assert meta["state"]["iteration"] == 3  # the training state travels with the copy
    layout = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]
    resumed = train(2, TRAIN + ["--train-iters", "6", "--load", out] + layout)
    assert resumed == pytest.approx(losses[3:], rel=1e-5)


def test_relayout_refuses_a_layout_that_cannot_load(trained, tmp_path):
    out = tmp_path / "tp3"
    with pytest.raises(ConversionError, match="--target-tensor-parallel-size 3"):
        tool("convert_checkpoint").main(
            relayout_args(trained[0], str(out), "--target-tensor-parallel-size", "3")
        )
    assert not out.exists()


LLAMA = GPTConfig.llama(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                        ffn_hidden_size=96, vocab_size=100, make_vocab_size_divisible_by=8)  # fmt: skip


@pytest.mark.parametrize(
    "target, match",
    [
        (Target(tp=4), r"--num-query-groups \(2\) must be divisible"),
        (Target(tp=2, pp=3), r"--num-layers \(4\) must be divisible"),
        (Target(pp=2, num_layers_per_virtual_pipeline_stage=3), "must divide the layers"),
        (
            Target(tp=2, pp=1, num_layers_per_virtual_pipeline_stage=1),
            "virtual pipeline stages need",
        ),
    ],
)
def test_check_layout_names_the_flag(target, match):
    with pytest.raises(ConversionError, match=match):
        check_layout(LLAMA, target)


def test_check_layout_finds_uneven_pieces_and_empty_vocab_ranks():
    check_layout(LLAMA, Target(tp=2, pp=2, num_layers_per_virtual_pipeline_stage=1))
    odd_ffn = LLAMA.with_(ffn_hidden_size=97)
    with pytest.raises(ConversionError, match=r"linear_fc1.*not divisible by tp 2"):
        check_layout(odd_ffn, Target(tp=2))
    with pytest.raises(ConversionError, match="no rows"):
        check_layout(LLAMA.with_(make_vocab_size_divisible_by=128), Target(tp=2))


@pytest.mark.parametrize("cfg", [LLAMA, GPTConfig.gpt2(num_layers=2, hidden_size=64,
                         num_attention_heads=4, vocab_size=100, openai_gelu=True,
                         untie_embeddings_and_output_weights=True, norm_epsilon=1e-6)])  # fmt: skip
def test_model_flags_rebuild_the_model(cfg):
    from megadyn.training.arguments import parse_args

    job = ["--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
           "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "99",
           "--hidden-dropout", "0", "--attention-dropout", "0"]  # fmt: skip
    parsed = parse_args(model_flags(cfg) + job, world_size=1).model
    assert parsed == cfg.with_(ffn_hidden_size=cfg.ffn_size)
