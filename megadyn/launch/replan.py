"""A layout for the processes a torchrun restart came back with.

    cfg = config_for_world(argv, world, restarted=restart > 0, device_type="cuda")

Under `torchrun --nnodes MIN:MAX` a restart may bring back fewer (or more) workers than the job
started with. Where the command line's tp x pp still fits the new world and the global batch,
only dp changes, as at a first start. Where it does not, a restarted job under
`--elastic-layout auto` asks the layout planner (megadyn/elastic/planning/requests.py `plan_layout`) for
tp, pp, vpp and sequence parallelism over the new world, keeping the micro batch size, the
recomputation and the global batch size; the job then loads its layout-free snapshot under
that layout. A first start, or `--elastic-layout pinned`, reports the error instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from megadyn.core.layout import Layout, LayoutError
from megadyn.elastic.planning.requests import check_layout, plan_layout
from megadyn.training.arguments import parse_config, validate
from megadyn.training.config import ConfigError, MegadynConfig


def with_layout(cfg: MegadynConfig, layout: Layout) -> MegadynConfig:
    """`cfg` with the degrees of `layout` (dp follows from the world size)."""
    per_virtual = cfg.model.num_layers // (layout.pp * layout.vpp) if layout.vpp > 1 else None
    parallel = dataclasses.replace(
        cfg.parallel,
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        num_layers_per_virtual_pipeline_stage=per_virtual,
        sequence_parallel=layout.sequence_parallel,
    )
    training = cfg.training
    if layout.pp > 1 and training.enable_cuda_graph:  # a graph covers a single stage
        training = dataclasses.replace(training, enable_cuda_graph=False)
    return dataclasses.replace(cfg, parallel=parallel, training=training)


def config_for_world(
    argv: Sequence[str], world: int, *, restarted: bool, device_type: str, print_fn=None
) -> MegadynConfig:
    """The command line's config for `world` processes, its layout replanned when a restart
    came back with a world it does not fit; raises ConfigError naming the flag otherwise."""
    cfg = parse_config(argv, world)
    for needs_cuda, flag in (
        (cfg.training.enable_cuda_graph, "--enable-cuda-graph"),
        (cfg.model.comm_overlap == "copy-engine", "--tp-comm-overlap-transport copy-engine"),
    ):
        if needs_cuda and device_type != "cuda":
            raise ConfigError(f"{flag} needs CUDA devices (this run is on {device_type})")
    try:
        validate(cfg, world)
        return cfg
    except ConfigError as err:
        if not restarted or cfg.elastic.layout == "pinned":
            raise
        try:
            layout = plan_layout(cfg.model, cfg, world, device_type=device_type)
            check_layout(layout, cfg.model, cfg)
        except LayoutError as no_layout:
            raise ConfigError(f"{err} (and no layout fits {world} processes: {no_layout})") from err
        replanned = with_layout(cfg, layout)
        validate(replanned, world)  # an error of something else than the layout stays
        if print_fn is not None:
            graph_off = cfg.training.enable_cuda_graph and not replanned.training.enable_cuda_graph
            print_fn(
                f" recovery: the restart came back with {world} processes, which the layout "
                f"tp={cfg.parallel.tp} pp={cfg.parallel.pp} does not fit ({err}); the layout "
                f"planner chose tp={layout.tp} cp={layout.cp} pp={layout.pp} dp={layout.dp} "
                f"vpp={layout.vpp} "
                f"sequence_parallel={layout.sequence_parallel} (micro batch size and global "
                f"batch size kept{'; CUDA graph off: pp > 1' if graph_off else ''})",
                flush=True,
            )
        return replanned
