"""The layout planner: fits memory, prefers what the calibrated cost model says is faster; at
long sequences context parallelism, whose activations shrink with the tokens a rank holds and
whose ring exchange the attention hides."""

import dataclasses
from types import SimpleNamespace

import pytest

from megadyn.core.layout import Layout, LayoutError
from megadyn.core.recompute import RecomputeConfig
from megadyn.elastic.control.records import Request
from megadyn.elastic.planning.layouts import CostModel, LayoutPlanner, memory_gib
from megadyn.elastic.planning.requests import resolve_request
from megadyn.models import GPTConfig
from megadyn.training.arguments import parse_config

CFG = GPTConfig.gpt2(
    num_layers=24,
    hidden_size=2048,
    num_attention_heads=16,
    ffn_hidden_size=8192,
    vocab_size=50304,
    max_position_embeddings=2048,
    untie_embeddings_and_output_weights=True,
)


def test_memory_model_matches_measured_peak():
    # measured on H200 (BENCHMARKS.md): tp1 31.8 GiB, tp2 16.8 GiB, pp2 18.1 GiB (micro batch 2)
    for layout, measured in ((Layout(), 31.8), (Layout(tp=2), 16.8), (Layout(pp=2), 18.1)):
        model = memory_gib(CFG, layout, 2, 2048, RecomputeConfig())
        assert abs(model - measured) / measured < 0.25, (layout, model, measured)


def test_refuses_what_does_not_fit_and_picks_a_fitting_layout():
    small = LayoutPlanner(CFG, global_batch_size=16, seq_length=2048, gpu_memory_gib=12)
    with pytest.raises(LayoutError, match="does not fit"):
        small.choose(1)
    choice = small.choose(4)
    assert choice.memory_gib <= 12 and choice.layout.world_size == 4


def test_calibration_scales_the_cost_model():
    cost = CostModel()
    layout = Layout(tp=1)
    before = cost.step_seconds(CFG, layout, 2, 16, 2048, RecomputeConfig())
    cost.calibrate(CFG, 16, 2048, [(layout, 2, RecomputeConfig(), 2 * before)])
    assert cost.step_seconds(CFG, layout, 2, 16, 2048, RecomputeConfig()) == pytest.approx(
        2 * before
    )
    planner = LayoutPlanner(
        CFG,
        global_batch_size=16,
        seq_length=2048,
        gpu_memory_gib=80,
        cost=cost,
        micro_batch_sizes=(2,),
        recomputes=(RecomputeConfig(),),
    )
    pinned = planner.choose(2, pinned=Layout(tp=2, dp=1))
    assert pinned.layout == Layout(tp=2, dp=1) and pinned.micro_batch_size == 2


LONG = 98304  # tokens: tp 2 x dp 2 does not fit 80 GiB without recomputation at this length
NO_RECOMPUTE = (RecomputeConfig(),)


def long_cfg(seq: int) -> GPTConfig:
    return dataclasses.replace(CFG, max_position_embeddings=seq)


def test_activations_scale_with_the_tokens_a_rank_holds():
    # cp 2 at 2S holds S tokens a rank, as dp 2 at S does, with the same optimizer shards; the
    # ring also keeps its own and the received keys and values of every layer for the
    # backward (bf16), unless every layer is recomputed
    for s in (4096, 32768):
        for rc in (RecomputeConfig(), RecomputeConfig("full", "uniform", 1)):
            cp = memory_gib(long_cfg(2 * s), Layout(cp=2), 1, 2 * s, rc)
            dp = memory_gib(long_cfg(2 * s), Layout(dp=2), 1, s, rc)
            kept = 0 if rc.granularity == "full" else 2 * 2 * 2 * s * CFG.hidden_size
            assert cp == pytest.approx(dp + kept * CFG.num_layers / 2**30)
    short, long = (
        memory_gib(long_cfg(s), Layout(tp=2), 1, s, RecomputeConfig()) for s in (8192, LONG)
    )
    assert long > 4 * short  # activations, not weights, dominate at long sequences


def test_ring_exchange_is_hidden_by_attention_at_long_sequences_only():
    cost, tp2cp2 = CostModel(), Layout(tp=2, cp=2)

    def merges(seq):  # the blocks' fp32 merges and gradient sums, which nothing hides
        return 64 * (seq // 2) * CFG.hidden_size / 2 / cost.memory_bandwidth

    assert cost.ring_seconds_per_layer(CFG, tp2cp2, 1, 2048) > merges(2048)
    assert cost.ring_seconds_per_layer(CFG, tp2cp2, 1, LONG) == pytest.approx(merges(LONG))
    assert cost.ring_seconds_per_layer(CFG, Layout(tp=4), 1, LONG) == 0


def test_planner_picks_cp_for_long_sequences_and_not_for_short_ones():
    planner = LayoutPlanner(
        long_cfg(LONG), global_batch_size=8, seq_length=LONG, gpu_memory_gib=80,
        micro_batch_sizes=(1,), recomputes=NO_RECOMPUTE,
    )  # fmt: skip
    for sp in (False, True):
        tp2dp2 = planner.evaluate(Layout(tp=2, dp=2, sequence_parallel=sp), 1, NO_RECOMPUTE[0])
        assert tp2dp2.memory_gib > 80
    choice = planner.choose(4)
    assert choice.layout.cp > 1 and choice.memory_gib <= 80
    for seq in (2048, 8192):
        short = LayoutPlanner(
            long_cfg(seq), global_batch_size=8, seq_length=seq, gpu_memory_gib=80,
            micro_batch_sizes=(1,), recomputes=NO_RECOMPUTE,
        )  # fmt: skip
        assert short.choose(4).layout.cp == 1
    no_cp = LayoutPlanner(
        long_cfg(LONG), global_batch_size=8, seq_length=LONG, gpu_memory_gib=80,
        micro_batch_sizes=(1,), recomputes=NO_RECOMPUTE, cp_sizes=(1,),
    )  # fmt: skip
    assert no_cp.choose(4).layout.cp == 1  # tp 4 (or SP) fits where cp is not allowed


def test_a2a_cp_divides_the_key_value_heads_of_each_tp_rank():
    cfg = dataclasses.replace(long_cfg(LONG), num_query_groups=2, cp_comm_type="a2a")
    planner = LayoutPlanner(
        cfg, global_batch_size=8, seq_length=LONG, gpu_memory_gib=80,
        micro_batch_sizes=(1,), recomputes=NO_RECOMPUTE,
    )  # fmt: skip
    layouts = {layout for layout, _, _ in planner.candidates(8)}
    assert any(layout.cp == 2 and layout.tp == 1 for layout in layouts)
    assert all((2 // layout.tp) % layout.cp == 0 for layout in layouts)  # no cp 4 or 8, no tp2cp2
    ring = dataclasses.replace(cfg, cp_comm_type="p2p")
    wide = LayoutPlanner(ring, global_batch_size=8, seq_length=LONG, gpu_memory_gib=80)
    assert any(layout.cp == 8 for layout, _, _ in wide.candidates(8))
    # one all-to-all each way per pass, nothing hidden behind the attention: linear in length
    cost = CostModel()
    a2a = [cost.ring_seconds_per_layer(cfg, Layout(cp=2), 1, seq) for seq in (LONG // 2, LONG)]
    assert 0 < 2 * a2a[0] == pytest.approx(a2a[1])


def test_live_layout_request_keeps_a2a_cp_within_the_key_value_heads():
    """An operator's `layout --cp 4` on an a2a job with 2 key/value heads is refused by name
    (the job keeps running); `--cp 2` is taken, and a scale under --elastic-layout auto plans
    a cp that a2a can run."""
    groups = SimpleNamespace(
        layout=Layout(tp=2), grid=SimpleNamespace(members=[0, 1, 2, 3]), backend="gloo"
    )
    gqa = ("--cp-comm-type", "a2a", "--group-query-attention", "--num-query-groups", "2")
    cfg = parse_config(job_argv(LONG, *gqa), 4)
    with pytest.raises(LayoutError, match="--cp-comm-type a2a"):
        resolve_request(Request(action="layout", tp=1, cp=4), cfg.model, cfg, groups, [0, 1, 2, 3])
    layout, _, _ = resolve_request(
        Request(action="layout", tp=1, cp=2), cfg.model, cfg, groups, [0, 1, 2, 3]
    )
    assert (layout.cp, layout.dp) == (2, 2)
    scale = Request(action="scale", members=8)
    layout, _, _ = resolve_request(
        scale, cfg.model, cfg, groups, list(range(8)), gpu_memory_gib=200
    )
    assert (2 // layout.tp) % layout.cp == 0


def job_argv(seq: int, *extra: str) -> list[str]:
    return [
        "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
        "--ffn-hidden-size", "8192", "--vocab-size", "50304", "--seq-length", str(seq),
        "--max-position-embeddings", str(seq), "--untie-embeddings-and-output-weights",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-4", "--bf16",
        "--use-distributed-optimizer", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--elastic-layout", "auto", "--train-iters", "10", "--attention-dropout", "0",
        "--hidden-dropout", "0", *extra,
    ]  # fmt: skip


def test_scale_request_takes_the_planned_cp_layout():
    """A live scale from 2 to 4 members under --elastic-layout auto at a long sequence moves to
    the planner's cp layout; with a feature cp does not run with, the planner keeps cp 1."""
    groups = SimpleNamespace(
        layout=Layout(tp=2), grid=SimpleNamespace(members=[0, 1]), backend="gloo"
    )
    scale = Request(action="scale", members=4)
    cfg = parse_config(job_argv(LONG), 2)
    layout, members, released = resolve_request(
        scale, cfg.model, cfg, groups, [0, 1, 2, 3], gpu_memory_gib=80
    )
    assert layout.cp > 1 and layout.world_size == 4 and sorted(members) == [0, 1, 2, 3]
    assert released == []
    graphed = parse_config(job_argv(LONG, "--enable-cuda-graph"), 2)
    layout, _, _ = resolve_request(
        scale, graphed.model, graphed, groups, [0, 1, 2, 3], gpu_memory_gib=80
    )
    assert layout.cp == 1
    short = parse_config(job_argv(4096), 2)
    layout, _, _ = resolve_request(
        scale, short.model, short, groups, [0, 1, 2, 3], gpu_memory_gib=80
    )
    assert layout.cp == 1
