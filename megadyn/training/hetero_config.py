"""--heterogeneous-pipelines at the start of a job: what it runs with, and its first layout.

    check_heterogeneous(cfg, world)          # validation.py: ConfigError naming the flags
    layout = first_layout(cfg, world, "cuda")    # a grid (Layout) or replicas (HeteroLayout)

With stage counts (`--heterogeneous-pipelines 3 2`) the job starts as those replicas, built
from the template planner's templates (megadyn/elastic/planning/hetero_job.py); without, on the command
line's grid where it fits the members, else on the planner's choice for them.
"""

from __future__ import annotations

from megadyn.core.hetero_layout import HeteroLayout
from megadyn.core.layout import Layout, LayoutError
from megadyn.elastic.planning.hetero_job import layout_with_templates, pipelines_layout
from megadyn.elastic.planning.requests import validate_for
from megadyn.training.config import ConfigError, MegadynConfig

FLAG = "--heterogeneous-pipelines"


def heterogeneous_conflicts(cfg: MegadynConfig) -> list[str]:
    """The flags of this job that replicas of different depth do not run with yet."""
    t, p = cfg.training, cfg.parallel
    unsupported = {
        "--num-distributed-optimizer-instances > 1": p.num_distributed_optimizer_instances > 1,
        "--num-layers-per-virtual-pipeline-stage": p.num_layers_per_virtual_pipeline_stage,
        "--context-parallel-size > 1": p.cp > 1,
        "--sequence-parallel": p.sequence_parallel,
        "--micro-batch-tokens": t.micro_batch_tokens is not None,
        "--rampup-batch-size": t.rampup_batch_size is not None,
        "--enable-cuda-graph": t.enable_cuda_graph,
        "--eval-interval (validation)": bool(
            t.eval_interval and t.eval_iters and t.eval_interval <= t.train_iters
        ),
    }
    return [flag for flag, used in unsupported.items() if used]


def check_heterogeneous(cfg: MegadynConfig, world_size: int) -> Layout | HeteroLayout:
    """Refuse what templates do not run with, naming both flags; the first layout."""
    for other in heterogeneous_conflicts(cfg):
        raise ConfigError(f"{FLAG} does not run with {other} yet: drop one of them")
    try:
        return first_layout(cfg, world_size, device_type="cpu")
    except LayoutError as err:
        said = str(err)
        raise ConfigError(said if said.startswith(FLAG) else f"{FLAG}: {said}") from err


def first_layout(cfg: MegadynConfig, world_size: int, device_type: str):
    """The job's first layout over its initial members (LayoutError when none fits)."""
    members = range(cfg.elastic.members(world_size))
    depths = cfg.parallel.heterogeneous_pipelines
    if depths is None:
        return cfg.layout(world_size)
    if depths:
        return pipelines_layout(cfg.model, cfg, depths, members, device_type=device_type)
    try:
        grid = cfg.layout(world_size)
        validate_for(grid, cfg.model, cfg)
        return grid
    except LayoutError:
        return layout_with_templates(cfg.model, cfg, members, device_type=device_type)
