"""All-to-all attention over the cp group (--cp-comm-type a2a): before attention each rank
trades the sequence for heads, after it the heads back for the sequence.

    q, k, v = scatter_heads([q, k, v], cp_group)   # [b, h, S/cp, d] -> [b, h/cp, S, d]
    out = attention(q, k, v)                          # the whole sequence, as without cp
    out = gather_heads(out, cp_group)                 # [b, n/cp, S, d] -> [b, n, S/cp, d]

cp rank r receives heads r*h/cp .. (r+1)*h/cp - 1 of every rank's tokens and lays them out in
sequence order (sequence.py's chunks: rank j sent chunks j and 2cp-1-j). Every rank then runs
the attention of one cp rank's worth of heads over the whole sequence: the same kernel call
as without context parallelism, under the causal or the document mask of the whole sequence,
so there is nothing to merge and every rank's work is equal whatever the masks. Grouped
queries split with their key/value heads (query heads are grouped by key/value head), so
the key/value heads per tensor-parallel rank must be a multiple of cp.

The exchange is one all-to-all per direction and pass (queries, keys and values travel in
one): a rank sends (cp-1)/cp of its q, k, v and output, where the ring sends its keys and
values cp-1 times. The backward runs the opposite exchange on the gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    """Row i of `send` [cp, n] to cp rank i; row j of the result came from cp rank j."""
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received


def _pack(tensors, shape, fill, cp: int) -> torch.Tensor:
    """[cp, total]: row i holds what `fill(view, t)` writes into `view` [cp, *shape(t)] at
    row i, for every tensor t, one after another."""
    shapes = [shape(t) for t in tensors]
    total = sum(torch.Size(s).numel() for s in shapes)
    t0 = tensors[0]
    send = torch.empty(cp, total, dtype=t0.dtype, device=t0.device)
    offset = 0
    for t, s in zip(tensors, shapes):
        size = torch.Size(s).numel()
        fill(send[:, offset : offset + size].view(cp, *s), t)
        offset += size
    return send


def _unpack(received: torch.Tensor, shapes) -> list[torch.Tensor]:
    """Views of `received` [cp, total] as one [cp, *shape] tensor per shape, in order."""
    out, offset = [], 0
    for shape in shapes:
        size = torch.Size(shape).numel()
        out.append(received[:, offset : offset + size].view(received.shape[0], *shape))
        offset += size
    return out


def _heads_to_sequence(tensors, group) -> list[torch.Tensor]:
    """[b, h, s, d] each (this rank's chunks) -> [b, h/cp, cp*s, d] (one rank's share of the
    heads, in sequence order)."""
    cp = dist.get_world_size(group)

    def shape(t):
        b, h, s, d = t.shape
        return b, h // cp, s, d

    def fill(view, t):  # row i: heads of rank i
        view.copy_(t.unflatten(1, (cp, -1)).transpose(0, 1))

    received = _all_to_all(_pack(tensors, shape, fill, cp), group)
    halves = [(b, h, 2, s // 2, d) for b, h, s, d in map(shape, tensors)]
    out = []
    for part in _unpack(received, halves):  # [cp (source), b, h/cp, 2, c, d]
        # chunk i of the sequence: source i's first (i < cp), else source 2cp-1-i's second
        chunks = [part[i, :, :, 0] for i in range(cp)]
        chunks += [part[i, :, :, 1] for i in reversed(range(cp))]
        out.append(torch.stack(chunks, dim=2).flatten(2, 3))
    return out


def _sequence_to_heads(tensors, group) -> list[torch.Tensor]:
    """The inverse: [b, h/cp, cp*s, d] each -> [b, h, s, d] (every head, this rank's chunks)."""
    cp = dist.get_world_size(group)

    def shape(t):  # what goes to each rank: its two chunks
        b, h, seq, d = t.shape
        return b, h, 2, seq // (2 * cp), d

    def fill(view, t):  # row r: chunks r and 2cp-1-r
        chunks = t.unflatten(2, (2 * cp, -1))
        for r in range(cp):
            view[r, :, :, 0].copy_(chunks[:, :, r])
            view[r, :, :, 1].copy_(chunks[:, :, 2 * cp - 1 - r])

    received = _all_to_all(_pack(tensors, shape, fill, cp), group)
    local = [(b, h, 2 * c, d) for b, h, _, c, d in map(shape, tensors)]
    # [cp (source), b, h/cp, s, d] -> [b, h, s, d]: source j held heads j*h/cp ..
    return [p.transpose(0, 1).flatten(1, 2) for p in _unpack(received, local)]


class _ScatterHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(_heads_to_sequence(tensors, group))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *_sequence_to_heads(grads, ctx.group))


class _GatherHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(_sequence_to_heads(tensors, group))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *_heads_to_sequence(grads, ctx.group))


def scatter_heads(tensors, group) -> list[torch.Tensor]:
    """This rank's part of the sequence [b, h, S/cp, d] of each tensor (heads divisible by cp)
    -> heads h/cp of cp rank's share over the whole sequence [b, h/cp, S, d]."""
    return list(_ScatterHeads.apply(group, *tensors))


def gather_heads(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of `scatter_heads` for one tensor: [b, h/cp, S, d] -> [b, h, S/cp, d]."""
    (out,) = _GatherHeads.apply(group, x)
    return out
