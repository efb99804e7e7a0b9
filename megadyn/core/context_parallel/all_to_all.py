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

The exchange is one batch of point-to-point transfers per direction and pass (queries, keys
and values travel in one): a rank sends (cp-1)/cp of its q, k, v and output, where the ring
sends its keys and values cp-1 times. Each chunk is received straight into its place in the
sequence, so the way in costs one copy (the senders' packing of each peer's heads) and the way
out one (the receiver's putting the heads side by side). The backward runs the opposite
exchange on the gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megadyn.core.context_parallel.comm import exchange, wait
from megadyn.core.context_parallel.sequence import chunk_ids


def _slots(x: torch.Tensor, rank: int, cp: int) -> list[torch.Tensor]:
    """The places in `x` [S, ...] (sequence order) of cp rank `rank`'s two chunks."""
    c = x.shape[0] // (2 * cp)
    return [x[i * c : (i + 1) * c] for i in chunk_ids(rank, cp)]


def _to_sequence(tensors, group) -> list[torch.Tensor]:
    """[s, b, h, d] each (this rank's chunks, every head) -> [cp*s, b, h/cp, d] (the heads of
    this cp rank, the whole sequence in order)."""
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    sends, receives, outs = {}, {}, []
    for x in tensors:
        s, b, h, d = x.shape
        hp, c = h // cp, s // 2
        out = x.new_empty(cp * s, b, hp, d)
        for peer in range(cp):
            heads = x[:, :, peer * hp : (peer + 1) * hp]
            if peer == me:
                for slot, part in zip(_slots(out, me, cp), (heads[:c], heads[c:])):
                    slot.copy_(part)
                continue
            packed = heads.contiguous()
            sends.setdefault(peer, []).extend([packed[:c], packed[c:]])
            receives.setdefault(peer, []).extend(_slots(out, peer, cp))
        outs.append(out)
    wait(exchange(group, sends, receives))
    return outs


def _to_heads(tensors, group) -> list[torch.Tensor]:
    """The inverse: [cp*s, b, h/cp, d] each -> [s, b, h, d]."""
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    sends, receives, staged = {}, {}, []
    for y in tensors:
        seq, b, hp, d = y.shape
        s = seq // cp
        stage = y.new_empty(cp, s, b, hp, d)  # [source rank: its heads, this rank's chunks]
        for peer in range(cp):
            halves = [stage[peer][: s // 2], stage[peer][s // 2 :]]
            if peer == me:
                for half, slot in zip(halves, _slots(y, me, cp)):
                    half.copy_(slot)
                continue
            sends.setdefault(peer, []).extend(_slots(y, peer, cp))
            receives.setdefault(peer, []).extend(halves)
        staged.append(stage)
    wait(exchange(group, sends, receives))
    return [t.permute(1, 2, 0, 3, 4).flatten(2, 3) for t in staged]


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    """[s, b, h, d] -> [b, h, s, d] (a view)."""
    return t.permute(1, 2, 0, 3)


def _sbhd(t: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] -> [s, b, h, d] (a view)."""
    return t.permute(2, 0, 1, 3)


class _ScatterHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(_bhsd(t) for t in _to_sequence([_sbhd(t) for t in tensors], group))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *(_bhsd(g) for g in _to_heads([_sbhd(g) for g in grads], ctx.group)))


class _GatherHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, x):
        ctx.group = group
        (out,) = _to_heads([_sbhd(x)], group)
        return _bhsd(out)

    @staticmethod
    def backward(ctx, grad):
        (out,) = _to_sequence([_sbhd(grad)], ctx.group)
        return None, _bhsd(out)


def scatter_heads(tensors, group) -> list[torch.Tensor]:
    """This rank's part of the sequence [b, h, S/cp, d] of each tensor (heads divisible by cp)
    -> heads h/cp of cp rank's share over the whole sequence [b, h/cp, S, d] (a view of a
    sequence-major tensor, the layout attention kernels take as it is)."""
    return list(_ScatterHeads.apply(group, *tensors))


def gather_heads(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of `scatter_heads` for one tensor: [b, h/cp, S, d] -> [b, h, S/cp, d]."""
    return _GatherHeads.apply(group, x)
