"""Attention under a dynamic placement (--cp-placement dynamic, placement.py): each cp rank
computes the (query block, key block) pairs of its own query blocks that hold a visible pair,
and receives only the key/value blocks those pairs read from the ranks that hold them.

    out = dynamic_attention(q, k, v, cp_group, placement, document_ids)   # q [b, n, s, d]

Forward: the exchange of the needed key/value blocks starts (one message per pair of ranks
that need anything from each other), the pairs on the rank's own keys are computed meanwhile
(the diagonal block of each query block first, so every query row starts with a visible key),
then those on the received keys; blocks merge through their log-sum-exp (blocks.py). The
received blocks are kept for the backward, which computes the pairs on received keys first,
sends the gradients of those keys back to their owners while it computes the local pairs, and
adds what comes back to the gradients of the rank's own keys and values.

A pair of kind "full" or "causal" runs through kernels.py's block kernel (fused on the GPU);
"masked" pairs (a document boundary inside) through blocks.py's math under the document mask.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megadyn.core.context_parallel.blocks import merge_into
from megadyn.core.context_parallel.kernels import block_kernels
from megadyn.core.context_parallel.placement import MASKED, BlockPlacement


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


def _key_slices(placement, rank, receives, buffers) -> dict[int, tuple[torch.Tensor, slice]]:
    """{key block: (tensor [2, b, g, *, d] holding it, its columns there)}."""
    n = placement.block_size
    where = {}
    for i, k in enumerate(placement.blocks[rank]):
        where[k] = ("own", slice(i * n, (i + 1) * n))
    for peer, blocks in receives.items():
        for j, k in enumerate(blocks):
            where[k] = (peer, slice(j * n, (j + 1) * n))
    return where


def _visible(document_ids, placement, q_block, k_block, kind):
    """[b, 1, N, N] document mask of a masked pair (None otherwise)."""
    if kind != MASKED:
        return None
    n = placement.block_size
    q_doc = document_ids[:, q_block * n : (q_block + 1) * n]
    k_doc = document_ids[:, k_block * n : (k_block + 1) * n]
    return (q_doc.unsqueeze(-1) == k_doc.unsqueeze(-2)).unsqueeze(1)


class _DynamicAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, placement, document_ids, scale, kernel):
        rank = dist.get_rank(group)
        n = placement.block_size
        kv = torch.stack([k, v])  # [2, b, g, s, d]
        sends, receives = _exchange_plan(placement, rank)
        buffers, pending = _start(group, sends, receives, kv, placement, rank)
        where = _key_slices(placement, rank, receives, buffers)
        pairs = placement.pairs(rank)
        local = [p for p in pairs if where[p[1]][0] == "own"]
        remote = [p for p in pairs if where[p[1]][0] != "own"]
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)  # [b, n, s, d]
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for batch, wait in ((local, False), (remote, True)):
            if wait:
                _wait(pending)
            for i, kb, kind in batch:
                source, cols = where[kb]
                keys = kv if source == "own" else buffers[source]
                rows = slice(i * n, (i + 1) * n)
                visible = _visible(document_ids, placement, placement.blocks[rank][i], kb, kind)
                forward, _ = block_kernels(q, kernel, masked=visible is not None)
                diagonal = placement.blocks[rank][i] == kb  # causal; earlier key blocks are not
                qb, kb_, vb = q[:, :, rows], keys[0][:, :, cols], keys[1][:, :, cols]
                o, s = forward(qb, kb_, vb, diagonal, scale, visible)
                merge_into(out[:, :, rows], lse[:, :, rows], o.to(acc), s.to(lse.dtype))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *buffers.values())
        ctx.peers = list(buffers)
        ctx.group, ctx.placement, ctx.document_ids = group, placement, document_ids
        ctx.scale, ctx.kernel = scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *received = ctx.saved_tensors
        placement, group = ctx.placement, ctx.group
        rank, n = dist.get_rank(group), placement.block_size
        buffers = dict(zip(ctx.peers, received))
        kv = torch.stack([k, v])
        sends, receives = _exchange_plan(placement, rank)
        where = _key_slices(placement, rank, receives, buffers)
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        dremote = {
            peer: torch.zeros(b.shape, dtype=acc, device=q.device) for peer, b in buffers.items()
        }
        pairs = placement.pairs(rank)
        remote = [p for p in pairs if where[p[1]][0] != "own"]
        local = [p for p in pairs if where[p[1]][0] == "own"]
        pending, returned = [], {}
        for batch in (remote, local):
            for i, kb, kind in batch:
                source, cols = where[kb]
                keys = kv if source == "own" else buffers[source]
                grads = dkv if source == "own" else dremote[source]
                rows = slice(i * n, (i + 1) * n)
                qb_index = placement.blocks[rank][i]
                visible = _visible(ctx.document_ids, placement, qb_index, kb, kind)
                _, backward = block_kernels(q, ctx.kernel, masked=visible is not None)
                dq_b, dk_b, dv_b = backward(
                    dout[:, :, rows], q[:, :, rows], keys[0][:, :, cols], keys[1][:, :, cols],
                    out[:, :, rows], lse[:, :, rows], qb_index == kb, ctx.scale, visible,
                )  # fmt: skip
                dq[:, :, rows] += dq_b
                grads[0][:, :, cols] += dk_b
                grads[1][:, :, cols] += dv_b
            if batch is remote:  # the gradients of received keys go home while local pairs run
                returned, pending = _start_return(group, sends, dremote, placement, rank, dkv)
        _wait(pending)
        for peer, blocks in sends.items():
            rows = _block_rows(placement, rank, blocks).to(q.device)
            dkv.index_add_(3, rows, returned[peer])
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


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
    is given) of this rank's queries q [b, n, s, d] over the whole sequence, whose blocks of
    keys and values k, v [b, g, s, d] are spread over `group` as `placement` says."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _DynamicAttention.apply(q, k, v, group, placement, document_ids, scale, kernel)
