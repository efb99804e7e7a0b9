"""The state description of a heterogeneous layout: which rank holds which piece.

    desc = describe_hetero(cfg, hetero_layout)            # a StateDescription, as `describe`
    desc = describe_hetero(cfg, hetero_layout, distopt=DistOpt(bucket_size=None))
    plan = plan_between(describe(cfg, grid, members), desc)   # grid -> templates, and back

A stage of a replica holds, over its tp ranks, the pieces the same tp ranks hold of the whole
model (`describe` of the grid tp x 1 x 1), kept to the parts it holds: its layer ranges and its
embedding ends (`HeteroLayout.groups_of`, the parts its gradients are reduced with). Weights
are replicated over the replicas as over dp. Without the distributed optimizer so is the
optimizer state (the weight's pieces); with it, each reduce group's ranks (one stage per
replica; first and last stages for the tied word embedding) shard one gradient buffer: the
params of the group's parts in registration order, laid out by `plan_buckets` over the group's
size, the k-th rank of the group (ranks ascending, as process groups number them) owning the
k-th part of each bucket, as `DistributedDataParallel` builds it with `grad_groups`. The
reshard planner, checkpoints and snapshots read a heterogeneous layout through the same
description as a grid.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megadyn.core.hetero_layout import HeteroLayout, reduce_part
from megadyn.core.layout import Layout
from megadyn.elastic.reshard.description import (
    WORD_EMBEDDING,
    DistOpt,
    HeldPiece,
    StateDescription,
    describe,
    flat_ranges,
    registration_order,
)
from megadyn.models.config import GPTConfig


def _param_name(key: str) -> str | None:
    """The parameter a state key belongs to (model.<name>, optim.<name>.<k>); None for scalars."""
    kind, _, rest = key.partition(".")
    if kind == "model":
        return rest
    if kind == "optim":
        return rest.rsplit(".", 1)[0]
    return None


def describe_hetero(
    cfg: GPTConfig,
    layout: HeteroLayout,
    *,
    distopt: DistOpt | None = None,
    scalars: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
) -> StateDescription:
    """The pieces of every global tensor that each member of `layout` holds."""
    ranges, groups = layout.layer_ranges(), layout.reduce_groups()
    buffers: dict[tuple, list] = {}  # each reduce group's flat ranges, shared by its members
    whole = None
    pieces: dict[int, list[HeldPiece]] = {}
    for rep in layout.replicas:
        for stage in range(rep.num_stages):
            ranks = rep.stage_ranks(stage, layout.tp)
            whole = describe(cfg, Layout(tp=layout.tp), ranks, scalars=scalars)
            for rank in ranks:
                group_of = {g.part: g.ranks for g in groups if rank in g.ranks}
                pieces[rank] = [
                    p
                    for p in whole.pieces[rank]
                    if (name := _param_name(p.key)) is None or reduce_part(name, ranges) in group_of
                ]
                if distopt is not None:
                    pieces[rank] = _sharded_optimizer(
                        cfg, layout, rank, pieces[rank], distopt, group_of, buffers
                    )
    return StateDescription(whole.tensors, pieces)


def _sharded_optimizer(
    cfg: GPTConfig,
    layout: HeteroLayout,
    rank: int,
    held: list[HeldPiece],
    distopt: DistOpt,
    group_of: dict,
    buffers: dict,
) -> list[HeldPiece]:
    """`held` (a rank's weights and whole optimizer pieces) with each optimizer piece cut to
    the flat range this rank owns of its reduce group's buffer (dropped where it owns none).
    `group_of`: the ranks of each part's reduce group that `rank` is in; `buffers`: the flat
    ranges of each group's buffer, computed for its first member and kept for the others."""
    ranges = layout.layer_ranges()
    weights = {_param_name(p.key): p for p in held if p.key.startswith("model.")}
    by_group: dict[tuple[int, ...], list[str]] = {}  # each buffer's params, registered order
    for name in registration_order(cfg, list(weights)):
        by_group.setdefault(group_of[reduce_part(name, ranges)], []).append(name)
    owned: dict[str, tuple[int, int]] = {}
    for ranks, names in by_group.items():
        if (ranks, tuple(names)) not in buffers:
            numels = [weights[n].numel for n in names]
            separate = [layout.tied_embeddings and n == WORD_EMBEDDING for n in names]
            buffers[ranks, tuple(names)] = flat_ranges(numels, len(ranks), distopt, separate)
        per_rank = buffers[ranks, tuple(names)]
        owned.update({n: per_rank[i][ranks.index(rank)] for i, n in enumerate(names)})
    out = []
    for p in held:
        if not p.key.startswith("optim."):
            out.append(p)
            continue
        start, end = owned[_param_name(p.key)]
        if start < end:
            out.append(HeldPiece(p.key, p.offsets, p.sizes, start, end, (end - start,)))
    return out
