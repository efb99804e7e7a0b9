"""Turn an operator request into a new layout and member list, or refuse it with a reason.

    Request(action="layout", tp=1, pp=2, cp=1, vpp=1, sp=False, members=4)
    Request(action="scale", members=2, release=False)       # release: exit instead of standby
    Request(action="drain", rank=3)                         # rank 3 got SIGTERM: it exits

Members are kept in order; a scale-in keeps the first members, a scale-out adds standby
processes in rank order. Under `--elastic-layout pinned` a scale keeps tp, cp, pp and vpp; under
`auto` the layout planner picks the fastest layout that fits. A drain, like a failure
(recovery/decision.py), puts the first standby process in the leaving member's place (same
layout), else scales in to the other members (`replace_or_shrink`).
"""

from __future__ import annotations

import torch

from megadyn.core.hetero_layout import HeteroLayout
from megadyn.core.layout import Layout, LayoutError, canonical_members
from megadyn.core.tensor_parallel.fp8 import check_fp8_shapes
from megadyn.core.tensor_parallel.layers import vocab_range
from megadyn.elastic.config import JobConfig
from megadyn.elastic.control.records import Request
from megadyn.elastic.planning.layouts import LayoutPlanner, check_cp_heads, memory_gib
from megadyn.models.config import GPTConfig


def device_memory_gib(device_type: str) -> float | None:
    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30


def resolve_request(
    request: Request,
    model_cfg: GPTConfig,
    cfg: JobConfig,
    groups,
    live: list[int],
    cost=None,
    gpu_memory_gib=None,
):
    """(new layout, new members, released ranks) for `request`; raises LayoutError to refuse.
    `gpu_memory_gib` replaces the device's memory for the layout planner (None: the device's)."""
    members = list(groups.grid.members)
    standby = [r for r in live if r not in members]
    old = groups.layout
    templates = _templates_for(request, cfg)
    if templates is not None:  # --heterogeneous-pipelines: replicas from templates, or a grid
        return _resolve_with_templates(
            request, templates, model_cfg, cfg, groups, live, cost, gpu_memory_gib
        )
    if request.action == "layout":
        tp = old.tp if request.tp is None else request.tp
        pp = old.pp if request.pp is None else request.pp
        cp = old.cp if request.cp is None else request.cp
        n = len(members) if request.members is None else request.members
        if request.dp is not None:
            n = tp * cp * pp * request.dp
        layout = Layout.from_world(n, tp, pp, request.vpp, request.sp, cp=cp)
        layout = with_job_instances(layout, cfg)
    else:  # scale
        n = request.members
        layout = layout_for_count(n, model_cfg, cfg, groups, cost, gpu_memory_gib)
    _check_min_members(n, cfg)
    if n > len(members) + len(standby):
        raise LayoutError(
            f"{n} members requested but only {len(members) + len(standby)} processes are live"
        )
    new_members = members[:n] if n <= len(members) else members + standby[: n - len(members)]
    new_members = list(canonical_members(layout, new_members))
    check_layout(layout, model_cfg, cfg)
    released = [r for r in members if r not in new_members] if request.release else []
    return layout, new_members, released


def _templates_for(request: Request, cfg: JobConfig):
    """How a request under --heterogeneous-pipelines is planned: 'pipelines' (the request
    names replica depths), 'auto' (a scale under --elastic-layout auto), else None (a grid)."""
    if request.pipelines is not None:
        if cfg.parallel.heterogeneous_pipelines is None:
            raise LayoutError("replicas of different depth need --heterogeneous-pipelines")
        return "pipelines"
    on = cfg.parallel.heterogeneous_pipelines is not None and cfg.elastic.layout == "auto"
    return "auto" if on and request.action == "scale" else None


def _resolve_with_templates(
    request: Request,
    how: str,
    model_cfg: GPTConfig,
    cfg: JobConfig,
    groups,
    live,
    cost,
    gpu_memory_gib,
):
    """`resolve_request` for a layout of templates (megadyn/elastic/planning/hetero_job.py)."""
    from megadyn.elastic.planning import hetero_job  # it plans with this module's checks

    members = list(groups.grid.members)
    standby = [r for r in live if r not in members]
    tp = groups.layout.tp if request.tp is None else request.tp
    n = tp * sum(request.pipelines) if how == "pipelines" else request.members
    _check_min_members(n, cfg)
    if n > len(members) + len(standby):
        raise LayoutError(
            f"{n} members requested but only {len(members) + len(standby)} processes are live"
        )
    chosen = members[:n] if n <= len(members) else members + standby[: n - len(members)]
    device_type = "cuda" if groups.backend == "nccl" else "cpu"
    if how == "pipelines":
        layout = hetero_job.pipelines_layout(
            model_cfg, cfg, request.pipelines, sorted(chosen), device_type=device_type, tp=tp
        )
    else:
        layout = hetero_job.layout_with_templates(
            model_cfg,
            cfg,
            sorted(chosen),
            device_type=device_type,
            cost=cost,
            gpu_memory_gib=gpu_memory_gib,
        )
        if not isinstance(layout, HeteroLayout):
            layout_members = list(canonical_members(layout, chosen[: layout.world_size]))
            check_layout(layout, model_cfg, cfg)
            released = [r for r in members if r not in layout_members] if request.release else []
            return layout, layout_members, released
    new_members = list(layout.members)
    released = [r for r in members if r not in new_members] if request.release else []
    return layout, new_members, released


def resolve_drain(
    rank: int, model_cfg: GPTConfig, cfg: JobConfig, groups, live: list[int], cost=None
):
    """(new layout, new members, released ranks) without process `rank`, which exits; raises
    LayoutError to refuse (the job then falls back to --exit-signal-handler or SIGTERM)."""
    members = list(groups.grid.members)
    if rank == 0:
        raise LayoutError(
            "rank 0 hosts the control store (--elastic-control-port) that every process and "
            "tools/elastic_ctl.py use, so it cannot leave the job"
        )
    if rank not in live:
        raise LayoutError(f"rank {rank} is not a live process of the job")
    if rank not in members:  # a standby process: it leaves the live set, the layout stays
        return groups.layout, members, [rank]
    standby = [r for r in live if r not in members and r != rank]
    layout, new_members = replace_or_shrink(groups, members, [rank], standby, model_cfg, cfg, cost)
    return layout, new_members, [rank]


def replace_or_shrink(
    old, members, leaving, waiting, model_cfg: GPTConfig, cfg: JobConfig, cost=None
):
    """(layout, members) once the members in `leaving` go (a drain, a failure): the `waiting`
    standby processes, in order, take their places in the same layout (`old.layout`) when
    there are enough of them; else every process left, waiting ones too, runs under the layout
    for their count (`old`: the old groups, or anything with their `layout` and `backend`).
    LayoutError when no layout runs the job."""
    from megadyn.elastic.planning.hetero_job import layout_for_members, with_ranks_replaced

    gone = set(leaving)
    lost = [r for r in members if r in gone]
    if len(waiting) >= len(lost):
        return with_ranks_replaced(old.layout, members, dict(zip(lost, waiting)))
    rest = [r for r in members if r not in gone] + list(waiting)
    return layout_for_members(rest, model_cfg, cfg, old, cost=cost)


def layout_for_remaining(n: int, model_cfg: GPTConfig, cfg: JobConfig, groups, cost=None) -> Layout:
    """The layout for the `n` processes left after members leave (a drain, or a failure that
    no standby process covers), checked against the job; LayoutError when none runs it."""
    _check_min_members(n, cfg)
    layout = layout_for_count(n, model_cfg, cfg, groups, cost=cost)
    check_layout(layout, model_cfg, cfg)
    return layout


def layout_for_count(
    n: int, model_cfg: GPTConfig, cfg: JobConfig, groups, cost=None, gpu_memory_gib=None
) -> Layout:
    """The layout of `n` members after a scale: tp, cp, pp and vpp kept under `--elastic-layout
    pinned`, the layout planner's choice under `auto` (LayoutError when none fits)."""
    old = groups.layout
    if cfg.elastic.layout == "pinned":
        layout = Layout.from_world(n, old.tp, old.pp, old.vpp, old.sequence_parallel, cp=old.cp)
        return with_job_instances(layout, cfg)
    device_type = "cuda" if groups.backend == "nccl" else "cpu"
    return plan_layout(
        model_cfg, cfg, n, device_type=device_type, cost=cost, gpu_memory_gib=gpu_memory_gib
    )


def with_job_instances(layout: Layout, cfg: JobConfig) -> Layout:
    """`layout` with the job's --num-distributed-optimizer-instances where they divide its
    dp x cp, else one instance (the trainer logs the fallback when it builds the layout)."""
    return layout.with_distopt_instances(cfg.parallel.num_distributed_optimizer_instances)


def _check_min_members(n: int, cfg: JobConfig) -> None:
    if n < cfg.elastic.min_members:
        raise LayoutError(f"{n} members is below --elastic-min-members ({cfg.elastic.min_members})")


def plan_layout(
    model_cfg: GPTConfig,
    cfg: JobConfig,
    num_members: int,
    *,
    device_type: str,
    cost=None,
    gpu_memory_gib=None,
) -> Layout:
    """The layout planner's fastest layout for `num_members` that keeps the running micro batch
    size and recomputation (a scale request, and a restart whose world the job's layout does
    not fit); raises LayoutError when none fits. Context parallelism is considered unless the
    job uses a feature it does not run with; `gpu_memory_gib` None: the device's memory."""
    t = cfg.training
    gpu = gpu_memory_gib or device_memory_gib(device_type) or 1e9
    layout = (
        LayoutPlanner(
            model_cfg,
            global_batch_size=t.global_batch_size,
            seq_length=cfg.data.seq_length,
            gpu_memory_gib=gpu,
            distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
            cost=cost,
            micro_batch_sizes=(t.micro_batch_size,),
            recomputes=(t.recompute,),
            cp_sizes=(1,) if context_parallel_conflicts(cfg) else (1, 2, 4, 8),
            pp_sizes=(1,) if cfg.data.sample_per_document else None,  # one shape per stage
        )
        .choose(num_members)
        .layout
    )
    return with_job_instances(layout, cfg)


def validate_for(layout: Layout, model_cfg: GPTConfig, cfg: JobConfig) -> None:
    """`Layout.validate` against this job's model, sequence and batch sizes (LayoutError)."""
    layout.validate(
        num_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        seq_length=cfg.data.seq_length,
        global_batch_size=cfg.training.global_batch_size,
        micro_batch_size=cfg.training.micro_batch_size,
    )
    check_cp_heads(model_cfg, layout)
    if model_cfg.fp8 is not None:
        tokens = cfg.training.micro_batch_size * cfg.data.seq_length // layout.cp
        try:
            check_fp8_shapes(model_cfg.fp8_gemm_sizes, layout.tp, tokens)
        except ValueError as err:
            raise LayoutError(str(err)) from err


def context_parallel_conflicts(cfg: JobConfig) -> list[str]:
    """The flags of this job that context parallelism does not run with yet, the one place
    where they are listed: validation refuses them with --context-parallel-size > 1, and the
    layout planner then considers cp 1 only. In-memory snapshots are layout-free DCP
    checkpoints like --save's, so they run under cp (and resume under any other layout);
    attention dropout draws reproducible per-block masks (core/context_parallel/dropout.py)."""
    unsupported = {
        "--enable-cuda-graph": cfg.training.enable_cuda_graph,
        "--tp-comm-overlap": cfg.model.tp_comm_overlap,
        "--sample-per-document": cfg.data.sample_per_document,
    }
    return [flag for flag, used in unsupported.items() if used]


def check_layout(layout: Layout, model_cfg: GPTConfig, cfg: JobConfig) -> None:
    """Every reason a layout cannot run this job, as a LayoutError naming it."""
    t = cfg.training
    validate_for(layout, model_cfg, cfg)
    if cfg.data.sample_per_document and layout.pp > 1:
        raise LayoutError("--sample-per-document does not run with pipeline parallelism yet")
    padded = model_cfg.padded_vocab_size(layout.tp)
    start, end = vocab_range(model_cfg.vocab_size, padded, layout.tp - 1, layout.tp)
    if end <= start:
        raise LayoutError(
            f"vocabulary of {model_cfg.vocab_size} leaves the last of {layout.tp} tp ranks no rows"
        )
    gpu = device_memory_gib("cuda")
    if gpu is not None:
        need = memory_gib(
            model_cfg,
            layout,
            t.micro_batch_size,
            cfg.data.seq_length,
            t.recompute,
            cfg.optimizer.use_distributed_optimizer,
        )
        if need > gpu:
            raise LayoutError(
                f"the model does not fit: {need:.1f} GiB per GPU needed, {gpu:.1f} GiB available"
            )
