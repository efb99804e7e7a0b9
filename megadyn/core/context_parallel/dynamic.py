"""Attention under a dynamic placement (--cp-placement dynamic, placement.py): each cp rank
receives only the key/value blocks its queries read from the ranks that hold them, then
computes all of its queries' attention in one varlen kernel call (varlen.py).

    out = dynamic_attention(q, k, v, cp_group, placement, document_ids)   # q [b, n, s, d]

Forward: the exchange of the needed key/value blocks (one message per pair of ranks that need
anything from each other) runs while the rank derives its segments (once per micro batch):
each run of its query tokens that are consecutive in the sequence and of one document, over
that document's keys from its start to the run's end. The keys of all segments are packed
(a key that several segments read is copied into each) and one call computes every query row
(causal within its document, --reset-attention-mask; over the whole sequence without document
ids). The received blocks are kept for the backward, which repacks the keys, makes one
backward call, sums each packed key's gradients at its position (fp32), sends the gradients of
received keys back to their owners and adds what comes back to the rank's own.

--cp-placement static_blocks runs the static split's blocks through the same path: the
comparison point of the placement alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megadyn.core.context_parallel.documents import packed
from megadyn.core.context_parallel.placement import BlockPlacement
from megadyn.core.context_parallel.varlen import VarlenPlan, varlen_backward, varlen_forward


def _needs(placement: BlockPlacement, rank: int) -> list[int]:
    """Key blocks of other ranks that `rank`'s pairs read, increasing."""
    own = set(placement.blocks[rank])
    return sorted({k for _, k, _ in placement.pairs(rank) if k not in own})


def _exchange_plan(placement: BlockPlacement, rank: int):
    """(sends, receives): {peer: [blocks]} this rank sends its own blocks to, and receives
    from, every rank computing the same plan."""
    owner = {k: r for r, held in enumerate(placement.blocks) for k in held}
    sends = {}
    for peer in range(placement.cp):
        wanted = [k for k in _needs(placement, peer) if owner[k] == rank] if peer != rank else []
        if wanted:
            sends[peer] = wanted
    receives = {}
    for k in _needs(placement, rank):
        receives.setdefault(owner[k], []).append(k)
    return sends, receives


def _block_rows(placement: BlockPlacement, rank: int, blocks: list[int]) -> torch.Tensor:
    """Local token rows of `rank`'s `blocks` (each one of its own)."""
    n, local = placement.block_size, placement.blocks[rank]
    return torch.cat([torch.arange(local.index(k) * n, (local.index(k) + 1) * n) for k in blocks])


def _start(group, sends: dict, receives: dict, source, placement, rank) -> tuple[dict, list]:
    """Start sending `source` [2, b, g, s, d]'s blocks of `sends` and receiving those of
    `receives`; returns ({peer: buffer}, pending work)."""
    n = placement.block_size
    ops, buffers = [], {}
    for peer, blocks in sends.items():
        rows = _block_rows(placement, rank, blocks).to(source.device)
        message = source.index_select(3, rows).contiguous()
        ops.append(dist.P2POp(dist.isend, message, dist.get_global_rank(group, peer), group))
    for peer, blocks in receives.items():
        shape = source.shape[:3] + (len(blocks) * n,) + source.shape[4:]
        buffers[peer] = torch.empty(shape, dtype=source.dtype, device=source.device)
        ops.append(dist.P2POp(dist.irecv, buffers[peer], dist.get_global_rank(group, peer), group))
    return buffers, (dist.batch_isend_irecv(ops) if ops else [])


def _wait(pending: list) -> None:
    for work in pending:
        work.wait()


def _positions(blocks, n: int, device) -> torch.Tensor:
    """Sequence positions of `blocks` of n tokens, in the blocks' order."""
    return torch.cat([torch.arange(k * n, (k + 1) * n, device=device) for k in blocks])


def _plan(placement: BlockPlacement, rank: int, ids, batch: int, device) -> VarlenPlan:
    """`rank`'s queries as varlen segments: per sample row, each run of its tokens that are
    consecutive in the sequence and of one document is a segment, over the keys from that
    document's start to the run's end (positions in the whole sequence, flattened over the
    rows). `ids` [b, S] on the host, or None (one document: causal over the sequence)."""
    seq = placement.kinds.shape[0] * placement.block_size
    pos = placement.token_index(rank)
    if ids is None:
        ids = torch.zeros(batch, seq, dtype=torch.long)
    index = torch.arange(seq)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    doc_start = torch.where(starts, index, 0).cummax(-1).values  # [b, S]
    q_len, k_len, keys = [], [], []
    for row in range(ids.shape[0]):
        mine = ids[row, pos]
        cut = torch.ones(pos.numel(), dtype=torch.bool)
        cut[1:] = (pos[1:] != pos[:-1] + 1) | (mine[1:] != mine[:-1])
        bounds = cut.nonzero().flatten().tolist() + [pos.numel()]
        for a, e in zip(bounds, bounds[1:]):
            first, last = doc_start[row, pos[a]].item(), pos[e - 1].item() + 1
            q_len.append(e - a)
            k_len.append(last - first)
            keys.append(torch.arange(row * seq + first, row * seq + last))
    return VarlenPlan.build(q_len, k_len, torch.cat(keys), device)


def _whole(kv, buffers: dict, receives: dict, placement: BlockPlacement, rank: int):
    """[2, b * S, g, d]: the keys and values of the whole sequence that this rank holds or
    received (kv [2, b, g, s, d], the received blocks in `buffers`), at their positions; the
    rest is never read."""
    n, seq = placement.block_size, placement.kinds.shape[0] * placement.block_size
    _, b, g, _, d = kv.shape
    whole = kv.new_empty(2, b, seq, g, d)
    whole.index_copy_(2, placement.token_index(rank, kv.device), kv.transpose(2, 3))
    for peer, blocks in receives.items():
        whole.index_copy_(2, _positions(blocks, n, kv.device), buffers[peer].transpose(2, 3))
    return whole.view(2, b * seq, g, d)


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """[b, n, s, d] -> [b * s, n, d] (a view where x is a transposed [b, s, n, d])."""
    b, n, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, n, d)


class _DynamicAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, placement, document_ids, scale, kernel):
        rank = dist.get_rank(group)
        kv = torch.stack([k, v])  # [2, b, g, s, d]
        sends, receives = _exchange_plan(placement, rank)
        buffers, pending = _start(group, sends, receives, kv, placement, rank)
        key = ("varlen", rank, q.shape[0], q.device)  # the same in every layer: once per batch
        if key not in placement.derived:
            host = None if document_ids is None else packed(document_ids).host
            placement.derived[key] = _plan(placement, rank, host, q.shape[0], q.device)
        plan = placement.derived[key]
        _wait(pending)
        keys, values = _whole(kv, buffers, receives, placement, rank).index_select(
            1, plan.key_index
        )
        out, saved = varlen_forward(_tokens_first(q), keys, values, plan, scale, kernel)
        ctx.save_for_backward(q, k, v, out, *saved, *buffers.values())
        ctx.n_saved, ctx.receives, ctx.plan = len(saved), receives, plan
        ctx.group, ctx.placement, ctx.scale, ctx.kernel = group, placement, scale, kernel
        b, n, s, d = q.shape
        return out.view(b, s, n, d).transpose(1, 2)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, *rest = ctx.saved_tensors
        saved, received = rest[: ctx.n_saved], rest[ctx.n_saved :]
        placement, group, plan, receives = ctx.placement, ctx.group, ctx.plan, ctx.receives
        rank, n = dist.get_rank(group), placement.block_size
        buffers = dict(zip(receives, received))
        kv = torch.stack([k, v])
        keys, values = _whole(kv, buffers, receives, placement, rank).index_select(
            1, plan.key_index
        )
        b, heads, s, d = q.shape
        dq, dk, dv = varlen_backward(
            _tokens_first(dout), _tokens_first(q), keys, values, out, saved, plan, ctx.scale,
            ctx.kernel,
        )  # fmt: skip
        acc = torch.promote_types(q.dtype, torch.float32)
        seq = placement.kinds.shape[0] * n
        dwhole = torch.zeros(2, b * seq, *k.shape[1:2], d, dtype=acc, device=q.device)
        dwhole.index_add_(1, plan.key_index, torch.stack([dk, dv]).to(acc))
        dwhole = dwhole.view(2, b, seq, -1, d)
        dremote = {
            peer: dwhole.index_select(2, _positions(blocks, n, q.device)).transpose(2, 3)
            for peer, blocks in receives.items()
        }
        dkv = dwhole.index_select(2, placement.token_index(rank, q.device)).transpose(2, 3)
        dkv = dkv.contiguous()
        sends, _ = _exchange_plan(placement, rank)
        returned, pending = _start_return(group, sends, dremote, placement, rank, dkv)
        _wait(pending)
        for peer, blocks in sends.items():
            rows = _block_rows(placement, rank, blocks).to(q.device)
            dkv.index_add_(3, rows, returned[peer])
        dq = dq.view(b, s, heads, d).transpose(1, 2)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def _start_return(group, sends, dremote, placement, rank, like) -> tuple[dict, list]:
    """Send each received block's key/value gradients back to its owner, and receive those of
    this rank's blocks that others read: the exchange of the forward, reversed."""
    n = placement.block_size
    ops, returned = [], {}
    for peer, grad in dremote.items():
        ops.append(
            dist.P2POp(dist.isend, grad.contiguous(), dist.get_global_rank(group, peer), group)
        )
    for peer, blocks in sends.items():
        shape = like.shape[:3] + (len(blocks) * n,) + like.shape[4:]
        returned[peer] = torch.empty(shape, dtype=like.dtype, device=like.device)
        ops.append(dist.P2POp(dist.irecv, returned[peer], dist.get_global_rank(group, peer), group))
    return returned, (dist.batch_isend_irecv(ops) if ops else [])


def dynamic_attention(
    q, k, v, group, placement: BlockPlacement, document_ids=None, scale=None, kernel=None
) -> torch.Tensor:
    """Causal attention (within documents when `document_ids` [b, S], the whole sequence's,
    or documents.py's PackedDocuments, is given) of this rank's queries q [b, n, s, d] over
    the whole sequence, whose blocks of keys and values k, v [b, g, s, d] are spread over
    `group` as `placement` says."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _DynamicAttention.apply(q, k, v, group, placement, document_ids, scale, kernel)
