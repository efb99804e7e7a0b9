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

The pairs are gathered into kernel calls: per query block its diagonal block (causal), and
per source of keys (this rank, or one peer) its wholly visible key blocks in one call (they are
consecutive there: one document's run of blocks) and its masked ones in another. Unmasked
calls run through kernels.py's block kernel (fused on the GPU); masked ones (a document
boundary inside) run the same fused kernel once per document (documents.py), or blocks.py's
math under the document mask where no fused kernel runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megadyn.core.context_parallel.blocks import merge_into
from megadyn.core.context_parallel.documents import (
    device_ids,
    document_rects,
    documents_backward,
    documents_forward,
    packed,
)
from megadyn.core.context_parallel.kernels import block_kernels, fused_kernels
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


def _key_slices(placement, rank, receives) -> dict[int, tuple[object, int]]:
    """{key block: (where it is: "own" or the peer it came from, its index there)}."""
    where = {k: ("own", i) for i, k in enumerate(placement.blocks[rank])}
    for peer, blocks in receives.items():
        where.update({k: (peer, j) for j, k in enumerate(blocks)})
    return where


@dataclass(frozen=True)
class _Call:
    """One kernel call: query block `i` (local) on key blocks `keys` held in one `source`."""

    i: int
    source: object
    """"own" (this rank's keys and values) or the peer whose blocks were received."""
    keys: tuple[int, ...]
    """Global key blocks, increasing."""
    cols: object
    """Their columns in the source: a slice when consecutive there, else an index tensor."""
    causal: bool
    """The diagonal block (local positions increase within it)."""
    masked: bool
    """A document boundary inside: the math kernel under the document mask."""


def _calls(placement: BlockPlacement, rank: int, where: dict, device) -> list[_Call]:
    """The pairs of `rank` gathered into kernel calls: per query block, its diagonal block, then
    per source its wholly visible key blocks in one call and its masked ones in another; the
    calls on this rank's own keys first."""
    n, grouped = placement.block_size, {}
    for i, k, kind in placement.pairs(rank):
        diagonal = placement.blocks[rank][i] == k
        grouped.setdefault((i, where[k][0], kind, diagonal), []).append(k)
    calls = []
    for (i, source, kind, diagonal), keys in grouped.items():
        keys = sorted(keys)
        at = [where[k][1] for k in keys]
        if at == list(range(at[0], at[0] + len(at))):
            cols = slice(at[0] * n, (at[-1] + 1) * n)
        else:
            cols = torch.cat([torch.arange(j * n, (j + 1) * n, device=device) for j in at])
        calls.append(_Call(i, source, tuple(keys), cols, diagonal, kind == MASKED))
    calls.sort(key=lambda c: (c.source != "own", not c.causal))
    return calls


def _take(x: torch.Tensor, cols) -> torch.Tensor:
    """x [..., s, d] at columns `cols` (a slice or an index tensor) of dim -2."""
    return x[..., cols, :] if isinstance(cols, slice) else x.index_select(-2, cols)


def _documents(document_ids, placement, q_block: int, call: _Call):
    """The document ids of a call's query rows [b, N] and key columns [b, n_keys]."""
    n = placement.block_size
    q_doc = document_ids[:, q_block * n : (q_block + 1) * n]
    k_doc = torch.cat([document_ids[:, k * n : (k + 1) * n] for k in call.keys], dim=1)
    return q_doc, k_doc


def _masks(documents, placement, rank: int, calls: list[_Call], fused) -> list:
    """Per call its document mask: None (unmasked), the visible rectangles of documents.py
    (masked, with a fused kernel; from the host copy of the ids) or the [b, 1, N, n_keys]
    mask of the math kernel."""
    masks = []
    for call in calls:
        if not call.masked:
            masks.append(None)
            continue
        q_block = placement.blocks[rank][call.i]
        if fused is not None:
            q_doc, k_doc = _documents(documents.host, placement, q_block, call)
            masks.append(document_rects(q_doc, k_doc, call.causal))
        else:
            q_doc, k_doc = _documents(device_ids(documents), placement, q_block, call)
            masks.append((q_doc.unsqueeze(-1) == k_doc.unsqueeze(-2)).unsqueeze(1))
    return masks


def _forward_call(q, kb, vb, call: _Call, scale, kernel, fused, mask):
    """(output, log-sum-exp) of one call, through the kernel its mask needs."""
    if isinstance(mask, list):
        return documents_forward(fused[0], q, kb, vb, scale, mask)
    forward, _ = block_kernels(q, kernel, masked=mask is not None)
    return forward(q, kb, vb, call.causal, scale, mask)


def _backward_call(dout, q, kb, vb, out, lse, call: _Call, scale, kernel, fused, mask):
    """The gradients of q, k and v of one call, through the kernel its mask needs."""
    if isinstance(mask, list):
        return documents_backward(fused[1], dout, q, kb, vb, out, lse, scale, mask)
    _, backward = block_kernels(q, kernel, masked=mask is not None)
    return backward(dout, q, kb, vb, out, lse, call.causal, scale, mask)


class _DynamicAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, placement, document_ids, scale, kernel):
        rank = dist.get_rank(group)
        n = placement.block_size
        kv = torch.stack([k, v])  # [2, b, g, s, d]
        sends, receives = _exchange_plan(placement, rank)
        buffers, pending = _start(group, sends, receives, kv, placement, rank)
        calls = _calls(placement, rank, _key_slices(placement, rank, receives), q.device)
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)  # [b, n, s, d]
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        fused = fused_kernels(q, kernel)
        if fused and document_ids is not None:  # the same in every layer: once per micro batch
            docs = packed(document_ids)
            key = ("dynamic", rank, id(placement))
            masks = docs.derived(key, lambda: _masks(docs, placement, rank, calls, fused))
        else:
            masks = _masks(document_ids, placement, rank, calls, fused)
        waited = False
        for call, mask in zip(calls, masks):  # own keys first (diagonal blocks first), received
            if call.source != "own" and not waited:
                _wait(pending)
                waited = True
            keys = kv if call.source == "own" else buffers[call.source]
            rows = slice(call.i * n, (call.i + 1) * n)
            kb, vb = _take(keys[0], call.cols), _take(keys[1], call.cols)
            o, s = _forward_call(q[:, :, rows], kb, vb, call, scale, kernel, fused, mask)
            merge_into(out[:, :, rows], lse[:, :, rows], o.to(acc), s.to(lse.dtype))
        if not waited:
            _wait(pending)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *buffers.values())
        ctx.peers, ctx.calls, ctx.masks, ctx.fused = list(buffers), calls, masks, fused
        ctx.group, ctx.placement = group, placement
        ctx.scale, ctx.kernel = scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *received = ctx.saved_tensors
        placement, group = ctx.placement, ctx.group
        rank, n = dist.get_rank(group), placement.block_size
        buffers = dict(zip(ctx.peers, received))
        kv = torch.stack([k, v])
        sends, _ = _exchange_plan(placement, rank)
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        dremote = {
            peer: torch.zeros(b.shape, dtype=acc, device=q.device) for peer, b in buffers.items()
        }
        pending, returned = [], {}
        calls = list(zip(ctx.calls, ctx.masks))
        remote = [(c, m) for c, m in calls if c.source != "own"]
        local = [(c, m) for c, m in calls if c.source == "own"]
        for batch in (remote, local):
            for call, mask in batch:
                keys = kv if call.source == "own" else buffers[call.source]
                grads = dkv if call.source == "own" else dremote[call.source]
                rows = slice(call.i * n, (call.i + 1) * n)
                kb, vb = _take(keys[0], call.cols), _take(keys[1], call.cols)
                dq_b, dk_b, dv_b = _backward_call(
                    dout[:, :, rows], q[:, :, rows], kb, vb, out[:, :, rows], lse[:, :, rows],
                    call, ctx.scale, ctx.kernel, ctx.fused, mask,
                )  # fmt: skip
                dq[:, :, rows] += dq_b
                if isinstance(call.cols, slice):
                    grads[0][..., call.cols, :] += dk_b
                    grads[1][..., call.cols, :] += dv_b
                else:
                    grads[0].index_add_(-2, call.cols, dk_b.to(acc))
                    grads[1].index_add_(-2, call.cols, dv_b.to(acc))
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
    or documents.py's PackedDocuments, is given) of this rank's queries q [b, n, s, d] over
    the whole sequence, whose blocks of keys and values k, v [b, g, s, d] are spread over
    `group` as `placement` says."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _DynamicAttention.apply(q, k, v, group, placement, document_ids, scale, kernel)
