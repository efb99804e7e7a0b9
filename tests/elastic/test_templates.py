"""Pipeline templates and the heterogeneous planner: balance, exact batch split, members used."""

import importlib.util
import itertools
from pathlib import Path

import pytest

from megadyn.core.layout import Layout
from megadyn.core.recompute import RecomputeConfig
from megadyn.elastic.planning.hetero import (
    HeteroPlan,
    HeteroPlanner,
    best_grid,
    grid_or_templates,
    split_microbatches,
)
from megadyn.elastic.planning.layouts import CostModel, LayoutPlanner, memory_gib
from megadyn.elastic.planning.templates import PipelineTemplate, StageModel
from megadyn.models import GPTConfig

BIG = GPTConfig.gpt2(  # 5 B parameters: a stage needs about half of an 80 GiB GPU's memory
    num_layers=24,
    hidden_size=4096,
    num_attention_heads=32,
    vocab_size=50304,
    max_position_embeddings=2048,
    untie_embeddings_and_output_weights=True,
)
PLANNER = LayoutPlanner(BIG, global_batch_size=32, seq_length=2048, gpu_memory_gib=80)


def toy_model(head: float = 2.5) -> StageModel:
    """Layers of cost 1 and an output layer of `head` layers."""
    return StageModel(1.0, head, 1.0, 3.0, 0.5, 2.0, 0.0, 10, 30)


def slowest_stage_brute_force(model: StageModel, layers: int, stages: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        sizes = [b - a for a, b in zip((0, *cuts), (*cuts, layers))]
        secs = [PipelineTemplate.stage_cost(model, k, s, stages)[0] for s, k in enumerate(sizes)]
        best = min(best, max(secs))
    return best


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
def test_template_balances_stages_around_the_output_layer(stages):
    model = toy_model()
    template = PipelineTemplate.balance(model, 9, stages)
    assert [r.start for r in template.stage_layers][0] == 0
    assert sum(len(r) for r in template.stage_layers) == 9
    assert max(template.stage_seconds) == slowest_stage_brute_force(model, 9, stages)
    if stages > 1:  # the output layer costs 2.5 layers: the last stage holds fewer
        sizes = [len(r) for r in template.stage_layers]
        assert sizes[-1] == min(sizes) < max(sizes)


def test_template_respects_memory_or_refuses():
    model = toy_model()
    free = PipelineTemplate.balance(model, 9, 3)
    limit = max(free.stage_gib) - 0.5
    tight = PipelineTemplate.balance(model, 9, 3, memory_limit_gib=limit)
    assert tight is None or max(tight.stage_gib) <= limit
    assert PipelineTemplate.balance(model, 9, 3, memory_limit_gib=1.0) is None


def test_stage_model_is_the_layout_planner_model_for_one_stage():
    rc, cost = RecomputeConfig("selective"), CostModel()
    for tp, replicas in ((1, 1), (2, 3), (4, 2)):
        model = StageModel.read(PLANNER, tp=tp, micro_batch_size=2, recompute=rc, replicas=replicas)
        template = PipelineTemplate.balance(model, BIG.num_layers, 1)
        layout = Layout(tp=tp, dp=replicas, sequence_parallel=tp > 1)
        step = cost.step_seconds(BIG, layout, 2, 2 * 4 * replicas, 2048, rc)
        modelled = template.replica_seconds(4) + template.reduce_seconds()
        assert modelled == pytest.approx(step, rel=1e-9)
        assert template.stage_gib[0] == pytest.approx(memory_gib(BIG, layout, 2, 2048, rc))


def test_split_is_exact_and_as_fast_as_any_split():
    model = toy_model()
    templates = [PipelineTemplate.balance(model, 9, s) for s in (3, 2, 2, 1)]
    for total in (4, 5, 11, 23):
        split = split_microbatches(templates, total)
        assert sum(split) == total and min(split) >= 1
        slowest = max(t.replica_seconds(m) for t, m in zip(templates, split))
        best = min(
            max(t.replica_seconds(m) for t, m in zip(templates, ms))
            for ms in itertools.product(range(1, total + 1), repeat=4)
            if sum(ms) == total
        )
        assert slowest == best
    split = split_microbatches(templates, 40)
    assert split[0] > split[1] == split[2] > split[3]  # deeper pipelines are faster
    with pytest.raises(ValueError, match="--global-batch-size"):
        split_microbatches(templates, 3)


def test_planner_uses_every_member_where_grids_cannot():
    hetero = HeteroPlanner(PLANNER)
    for n in (2, 3, 5, 7, 8, 11):
        plan = hetero.plan(n)
        grid = best_grid(PLANNER, n)
        assert plan.members_used == n >= grid.layout.world_size
        assert sum(plan.micro_batches) * plan.micro_batch_size == 32
        assert plan.memory_gib <= 80
        layout = plan.layout(range(n), BIG.num_layers)
        assert layout.world_size == n and layout.num_microbatches == sum(plan.micro_batches)
    for n in (5, 7, 11):  # no grid uses 5, 7 or 11 members of this model and batch
        assert best_grid(PLANNER, n).layout.world_size < n
    tp2 = hetero.evaluate(2, 1, RecomputeConfig("full", "uniform", 1), (3, 2))
    shuffled = tp2.layout(range(9, -1, -1), BIG.num_layers)  # members given in any order
    stages = [rep.stage_ranks(s, 2) for rep in shuffled.replicas for s in range(rep.num_stages)]
    assert stages == [(8, 9), (6, 7), (4, 5), (2, 3), (0, 1)]  # ascending within a stage
    assert isinstance(grid_or_templates(hetero, 5), HeteroPlan)
    assert grid_or_templates(hetero, 8).layout.world_size == 8  # a grid uses them all


def test_simulation_tool_prints_a_row_per_member_count(capsys):
    tool = Path(__file__).resolve().parents[2] / "tools" / "simulate_templates.py"
    spec = importlib.util.spec_from_file_location("simulate_templates", tool)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--members", "5", "6", "--layers", "24", "--global-batch-size", "32"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 24 ")]
    assert len(rows) == 2
    five = [cell.strip() for cell in rows[0].split("|")[1:-1]]
    assert five[2] == "5" and five[4] == "80%" and five[6] == "100%" and five[10] == "templates"
