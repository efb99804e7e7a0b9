"""The state description of a heterogeneous layout: which rank holds which piece.

    desc = describe_hetero(cfg, hetero_layout)            # a StateDescription, as `describe`
    plan = plan_between(describe(cfg, grid, members), desc)   # grid -> templates, and back

A stage of a replica holds, over its tp ranks, the pieces the same tp ranks hold of the whole
model (`describe` of the grid tp x 1 x 1), kept to the parts it holds: its layer ranges and its
embedding ends (`HeteroLayout.groups_of`, the parts its gradients are reduced with). Weights and
optimizer state (without the distributed optimizer: the weight's pieces) are replicated over
the replicas as over dp, so the reshard planner, checkpoints and snapshots read a heterogeneous
layout through the same description as a grid.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megadyn.core.hetero_layout import HeteroLayout, reduce_part
from megadyn.core.layout import Layout
from megadyn.elastic.description import HeldPiece, StateDescription, describe
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
    scalars: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
) -> StateDescription:
    """The pieces of every global tensor that each member of `layout` holds."""
    ranges = layout.layer_ranges()
    whole = None
    pieces: dict[int, list[HeldPiece]] = {}
    for rep in layout.replicas:
        for stage in range(rep.num_stages):
            ranks = rep.stage_ranks(stage, layout.tp)
            whole = describe(cfg, Layout(tp=layout.tp), ranks, scalars=scalars)
            parts = {g.part for g in layout.groups_of(ranks[0])}
            for rank in ranks:
                pieces[rank] = [
                    p
                    for p in whole.pieces[rank]
                    if (name := _param_name(p.key)) is None or reduce_part(name, ranges) in parts
                ]
    return StateDescription(whole.tensors, pieces)
