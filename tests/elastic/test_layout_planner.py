"""The layout planner: fits memory, prefers what the calibrated cost model says is faster."""

import pytest

from megadyn.core.layout import Layout, LayoutError
from megadyn.core.recompute import RecomputeConfig
from megadyn.elastic.layout_planner import CostModel, LayoutPlanner, memory_gib
from megadyn.models import GPTConfig

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
