"""--elastic-straggler-policy rebalance: the straggler's replica keeps its ranks and runs fewer
micro batches, the others more; the global batch stays the same.

    layout = rebalanced_layout(scores, model_cfg, cfg, groups)   # a HeteroLayout, or LayoutError

The layout is the current one as replicas of pipeline templates (megadyn/core/hetero_layout.py:
under --heterogeneous-pipelines a replica's micro batch count is its own, and the data loader
gives replica i the block of each step's micro batches after those of replicas before it, so
every sample is still read once). A replica's time per micro batch is its slowest member's
compute time over the micro batches it ran; the counts become proportional to the replicas'
speeds (at least one each, largest remainders first), and the change is made only when the
modelled step (the slowest replica's count x time) gets at least 5% shorter.
"""

from __future__ import annotations

import dataclasses

from megadyn.core.hetero_layout import HeteroLayout
from megadyn.core.layout import Layout, LayoutError, RankGrid
from megadyn.elastic.control.stragglers import StragglerScores

GAIN = 0.95
"""A rebalance must model the step at most this fraction of the current one."""


def rebalanced_layout(scores: StragglerScores, model_cfg, cfg, groups) -> HeteroLayout:
    """The current layout's replicas with micro batches split by measured speed."""
    from megadyn.elastic.planning.hetero_job import (
        pipelines_layout,  # it plans with planning/requests.py
    )

    layout = groups.layout
    if cfg.parallel.heterogeneous_pipelines is None:
        raise LayoutError("uneven micro batches per replica need --heterogeneous-pipelines")
    if isinstance(layout, Layout):
        if layout.cp > 1 or layout.vpp > 1:
            raise LayoutError("replicas of different micro batches do not run with cp or vpp")
        replicas = RankGrid(layout, tuple(groups.grid.members)).mp_groups()  # by dp rank
        device_type = "cuda" if groups.backend == "nccl" else "cpu"
        members = [r for rep in replicas for r in rep]  # replica-major, stage-major, tp fastest
        depths = [layout.pp] * layout.dp
        layout = pipelines_layout(
            model_cfg, cfg, depths, members, device_type=device_type, tp=layout.tp
        )
    compute = {r.rank: r.compute_s for r in scores.ranks}
    per_micro = [
        max(compute[m] for m in rep.members) / rep.micro_batches for rep in layout.replicas
    ]
    counts = split_by_speed(layout.num_microbatches, per_micro)
    old = max(rep.micro_batches * t for rep, t in zip(layout.replicas, per_micro))
    new = max(c * t for c, t in zip(counts, per_micro))
    if new > GAIN * old:
        raise LayoutError(
            f"micro batches split by speed ({counts}) model the step {new:.3f} s against "
            f"{old:.3f} s now: no gain"
        )
    replicas = tuple(
        dataclasses.replace(rep, micro_batches=c) for rep, c in zip(layout.replicas, counts)
    )
    return dataclasses.replace(layout, replicas=replicas)


def split_by_speed(total: int, seconds_per_micro: list[float]) -> list[int]:
    """`total` micro batches split in proportion to 1 / seconds, at least 1 each."""
    speeds = [1.0 / max(t, 1e-9) for t in seconds_per_micro]
    spare = total - len(speeds)  # one each first
    if spare < 0:
        raise LayoutError(f"{total} micro batches cannot give {len(speeds)} replicas one each")
    shares = [spare * s / sum(speeds) for s in speeds]
    counts = [1 + int(x) for x in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: int(shares[i]) - shares[i])
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts
