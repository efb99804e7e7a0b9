"""Weights and gradients between two tp x dp layouts over the same processes (hot switching).

A hot switch (megadyn/training/hot_switch.py) runs part of a step under another layout of the
same ranks (pp 1, cp 1): the weights go from the base layout's model to the other layout's copy
before its micro batches, and the gradients come back into the base layout's gradient buffers
after them. Both layouts hold every layer on every rank; only the tensor-parallel split
differs, so a tensor's move is at most one all-gather over the source layout's tp group (none
when the source holds whole tensors) and a local slice for the destination. The tensors of a
bucket (up to `bucket_numel` elements of whole tensors) travel in one all-gather, padded where
the vocabulary's split is uneven. The sharding table (megadyn/models/sharding.py) says which
piece each tp rank holds, so the moved values are exact.

    switch = LayoutSwitch(model_cfg, base_chunk, base_groups, other_chunk, other_groups)
    switch.weights_to_other()     # before the other layout's micro batches
    switch.grads_to_base()        # after its gradients are final: added to the base buffers
"""

from __future__ import annotations

import math

import torch

from megadyn.core.distributed.comm import all_gather_flat
from megadyn.models.config import GPTConfig
from megadyn.models.sharding import ParamSpec, Piece, param_specs, tp_piece


def _split(spec: ParamSpec) -> bool:
    return spec.vocab or spec.split_dim is not None


def gather_whole(
    items: list[tuple[ParamSpec, torch.Tensor]], cfg: GPTConfig, groups
) -> list[torch.Tensor]:
    """The global tensors of `items` ((spec, this tp rank's local tensor)) from the pieces
    every rank of `groups`' tp group holds: one all-gather for them all."""
    tp = groups.tp_size
    whole = [
        local.reshape(spec.shape) if not _split(spec) or tp == 1 else None for spec, local in items
    ]
    split = [(i, spec, local) for i, (spec, local) in enumerate(items) if whole[i] is None]
    if not split:
        return whole
    pieces: list[list[Piece]] = [
        [tp_piece(spec, cfg, tp, r) for _, spec, _ in split] for r in range(tp)
    ]
    sizes = [sum(math.prod(p.sizes) for p in rank_pieces) for rank_pieces in pieces]
    width = max(sizes)
    first = split[0][2]
    send = first.new_zeros(width)
    torch.cat([local.reshape(-1) for _, _, local in split], out=send[: sizes[groups.tp_rank]])
    received = first.new_empty(tp * width)  # [tp * width]: rank r's pieces at r * width
    all_gather_flat(received, send, groups.tp_group)
    for i, spec, _ in split:
        whole[i] = first.new_empty(spec.shape)
    for r in range(tp):
        offset = r * width
        for k, (i, _, _) in enumerate(split):
            piece = pieces[r][k]
            n = math.prod(piece.sizes)
            piece.put(whole[i], received[offset : offset + n])
            offset += n
    return whole


class LayoutSwitch:
    """Moves between a base layout's model chunk and another layout's (module docstring)."""

    def __init__(
        self,
        cfg: GPTConfig,
        base_chunk: torch.nn.Module,
        base_groups,
        other_chunk: torch.nn.Module,
        other_groups,
        bucket_numel: int = 2**26,
    ) -> None:
        self.cfg, self.base_groups, self.other_groups = cfg, base_groups, other_groups
        specs = param_specs(cfg)
        base = dict(base_chunk.named_parameters())
        other = dict(other_chunk.named_parameters())
        if base.keys() != other.keys():
            raise ValueError("the two layouts' model chunks hold different weights")
        self.buckets: list[list[tuple[ParamSpec, torch.nn.Parameter, torch.nn.Parameter]]] = [[]]
        size = 0
        for name, param in base.items():
            n = math.prod(specs[name].shape)
            if self.buckets[-1] and size + n > bucket_numel:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append((specs[name], param, other[name]))
            size += n

    @torch.no_grad()
    def weights_to_other(self) -> None:
        """Copy the base layout's weights into the other layout's chunk."""
        g = self.other_groups
        for bucket in self.buckets:
            items = [(spec, base.detach()) for spec, base, _ in bucket]
            for (spec, _, other), whole in zip(
                bucket, gather_whole(items, self.cfg, self.base_groups)
            ):
                other.copy_(tp_piece(spec, self.cfg, g.tp_size, g.tp_rank).take(whole))

    @torch.no_grad()
    def grads_to_base(self) -> None:
        """Add the other layout's final gradients (`main_grad`, reduced over its dp) to the
        base layout's `main_grad` buffers."""
        g = self.base_groups
        for bucket in self.buckets:
            items = [(spec, other.main_grad) for spec, _, other in bucket]
            for (spec, base, _), whole in zip(
                bucket, gather_whole(items, self.cfg, self.other_groups)
            ):
                base.main_grad.add_(tp_piece(spec, self.cfg, g.tp_size, g.tp_rank).take(whole))
