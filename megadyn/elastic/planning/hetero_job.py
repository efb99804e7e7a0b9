"""A job's layout is a grid or pipeline templates: the one place that tells them apart.

    layout = pipelines_layout(model_cfg, cfg, (3, 2), members=range(5), device_type="cpu")
    groups = build_groups(layout, members, timeout)        # ParallelGroups or HeteroGroups
    desc = describe_layout_state(model_cfg, layout, members, distopt)   # the reshard's input
    layout = layout_with_templates(model_cfg, cfg, n, members, device_type)   # a scale

Under --heterogeneous-pipelines a layout is a `HeteroLayout` (replicas of different pipeline
depth, megadyn/core/hetero_layout.py) or a grid (`Layout`). `pipelines_layout` makes replicas
of given depths from the template planner's templates (layers balanced by the cost model, micro
batches split by modelled speed); `layout_with_templates` is `--elastic-layout auto`'s choice
for a member count: the best grid, unless templates use more members and are modelled faster
(`grid_or_templates`). Groups, state descriptions and reshard plans are built for either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from megadyn.core.groups import ParallelGroups
from megadyn.core.hetero_groups import HeteroGroups
from megadyn.core.hetero_layout import HeteroLayout
from megadyn.core.layout import Layout, LayoutError, RankGrid, canonical_members
from megadyn.elastic.config import JobConfig
from megadyn.elastic.planning.hetero import HeteroPlan, HeteroPlanner, grid_or_templates
from megadyn.elastic.planning.layouts import LayoutPlanner
from megadyn.elastic.planning.requests import (
    check_layout,
    device_memory_gib,
    layout_for_remaining,
    validate_for,
)
from megadyn.elastic.reshard.description import DistOpt, describe
from megadyn.elastic.reshard.hetero_description import describe_hetero
from megadyn.models.config import GPTConfig


def build_groups(layout: Layout | HeteroLayout, members: Sequence[int], timeout=None):
    """The process groups of `layout` (every live process calls it, members or not)."""
    if isinstance(layout, HeteroLayout):
        return HeteroGroups.build(layout, timeout=timeout)
    return ParallelGroups.build(layout, members=members, timeout=timeout)


def describe_layout_state(
    model_cfg: GPTConfig, layout, members: Sequence[int], distopt: DistOpt | None
):
    """The state description of a grid or a heterogeneous layout."""
    if isinstance(layout, HeteroLayout):
        return describe_hetero(model_cfg, layout, distopt=distopt)
    return describe(model_cfg, layout, members, distopt=distopt)


def template_planner(
    model_cfg: GPTConfig, cfg: JobConfig, *, device_type: str, cost=None, gpu_memory_gib=None
):
    """The template planner on the job's model, batch, micro batch and recomputation."""
    t = cfg.training
    planner = LayoutPlanner(
        model_cfg,
        global_batch_size=t.global_batch_size,
        seq_length=cfg.data.seq_length,
        gpu_memory_gib=gpu_memory_gib or device_memory_gib(device_type) or 1e9,
        distributed_optimizer=False,  # a stage's whole optimizer state: a bound with ZeRO-1
        cost=cost,
        micro_batch_sizes=(t.micro_batch_size,),
        recomputes=(t.recompute,),
        cp_sizes=(1,),
    )
    return HeteroPlanner(planner)


def _layout_of(
    plan: HeteroPlan, model_cfg: GPTConfig, cfg: JobConfig, members: Sequence[int]
) -> HeteroLayout:
    validate_for(Layout(tp=plan.tp), model_cfg, cfg)  # heads, vocabulary, fp8 shapes over tp
    tied = not model_cfg.untie_embeddings_and_output_weights
    return plan.layout(members, model_cfg.num_layers, tied)


def pipelines_layout(
    model_cfg: GPTConfig,
    cfg: JobConfig,
    depths: Sequence[int],
    members: Sequence[int],
    *,
    device_type: str,
    tp=None,
) -> HeteroLayout:
    """Replicas of `depths` stages each (tp: the job's), over `members` in order."""
    tp = cfg.parallel.tp if tp is None else tp
    if len(members) != tp * sum(depths):
        raise LayoutError(
            f"--heterogeneous-pipelines {' '.join(map(str, depths))} x "
            f"--tensor-model-parallel-size {tp} needs {tp * sum(depths)} processes, "
            f"got {len(members)}"
        )
    hetero = template_planner(model_cfg, cfg, device_type=device_type)
    t = cfg.training
    for s in set(depths):
        if s > model_cfg.num_layers or not hetero.template(
            tp, t.micro_batch_size, t.recompute, len(depths), s
        ):
            raise LayoutError(
                f"--heterogeneous-pipelines: no {s}-stage template of --num-layers "
                f"{model_cfg.num_layers} fits the memory"
            )
    plan = hetero.evaluate(tp, t.micro_batch_size, t.recompute, tuple(depths))
    return _layout_of(plan, model_cfg, cfg, members)


def layout_with_templates(
    model_cfg: GPTConfig,
    cfg: JobConfig,
    members: Sequence[int],
    *,
    device_type: str,
    cost=None,
    gpu_memory_gib=None,
) -> Layout | HeteroLayout:
    """`--elastic-layout auto` under --heterogeneous-pipelines for `members`: the best grid
    (over as many of them as it uses) or the templates' mix (LayoutError when none fits)."""
    hetero = template_planner(
        model_cfg, cfg, device_type=device_type, cost=cost, gpu_memory_gib=gpu_memory_gib
    )
    choice = grid_or_templates(hetero, len(members))
    if isinstance(choice, HeteroPlan):
        return _layout_of(choice, model_cfg, cfg, members)
    return choice.layout.with_distopt_instances(cfg.parallel.num_distributed_optimizer_instances)


def job_members(layout: Layout | HeteroLayout, members: Sequence[int]) -> list[int]:
    """The members a layout is drawn over, in the layout's order."""
    if isinstance(layout, HeteroLayout):
        return list(layout.members)
    return list(members)[: layout.world_size]


def replicas_of(layout: Layout | HeteroLayout) -> dict:
    """What `tools/elastic_ctl.py show` adds for replicas of different depth: one line each."""
    if isinstance(layout, HeteroLayout):
        return {"replicas": layout.describe().splitlines()}
    return {}


def with_ranks_replaced(layout: Layout | HeteroLayout, members, fill: dict[int, int]):
    """(layout, members) with each rank `r` of `fill` replaced by `fill[r]` (a standby process
    takes a leaving member's place); a stage's ranks stay ascending."""
    if isinstance(layout, HeteroLayout):
        tp = layout.tp
        replicas = []
        for rep in layout.replicas:
            ranks: list[int] = []
            for s in range(rep.num_stages):
                ranks += sorted(fill.get(r, r) for r in rep.stage_ranks(s, tp))
            replicas.append(dataclasses.replace(rep, members=tuple(ranks)))
        new = dataclasses.replace(layout, replicas=tuple(replicas))
        return new, list(new.members)
    return layout, list(canonical_members(layout, [fill.get(r, r) for r in members]))


def layout_for_members(
    rest: Sequence[int], model_cfg: GPTConfig, cfg: JobConfig, groups, cost=None
):
    """(layout, members) for the processes `rest` left after members leave (a drain, or a
    failure no standby process covers): under --heterogeneous-pipelines with --elastic-layout
    auto a grid or templates, else the grid for their count (LayoutError when none runs)."""
    rest = list(rest)
    if cfg.parallel.heterogeneous_pipelines is not None and cfg.elastic.layout == "auto":
        if len(rest) < cfg.elastic.min_members:
            raise LayoutError(
                f"{len(rest)} members is below --elastic-min-members ({cfg.elastic.min_members})"
            )
        device_type = "cuda" if groups.backend == "nccl" else "cpu"
        layout = layout_with_templates(model_cfg, cfg, rest, device_type=device_type, cost=cost)
        if isinstance(layout, HeteroLayout):
            return layout, list(layout.members)
        check_layout(layout, model_cfg, cfg)
    else:
        layout = layout_for_remaining(len(rest), model_cfg, cfg, groups, cost=cost)
    return layout, list(canonical_members(layout, rest[: layout.world_size]))


def stage_and_tp(layout: Layout | HeteroLayout, members, rank: int) -> tuple[int, int]:
    """The (pipeline stage, tp rank) of `rank`: where its RNG streams belong."""
    if isinstance(layout, HeteroLayout):
        c = layout.coords_of(rank)
        return c.stage, c.tp
    c = RankGrid(layout, tuple(members)).coords_of(rank)
    return c.pp, c.tp
