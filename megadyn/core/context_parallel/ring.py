"""Ring attention over the cp group (--cp-comm-type p2p): keys and values travel around the
ring while each rank computes the attention of its queries on the block it holds.

Each rank holds two chunks of the sequence (sequence.py), queries q = [q_a; q_b] for chunks
r and 2cp-1-r. At ring step j it holds the keys and values of cp rank o = r - j (mod cp),
chunks o and 2cp-1-o, and only part of the causal attention is not masked:

    j = 0   (o = r): all queries on all local keys, causal (local positions are increasing)
    o < r          : all queries on the first half of the keys (chunk o), no mask
    o > r          : the second half of the queries (chunk 2cp-1-r) on all keys, no mask

so every step computes two chunks' worth of scores: the work is balanced over ranks and steps.
With `document_ids` (--reset-attention-mask) a block is further masked to query/key pairs of
the same document, and skipped, forward and backward, when it has none (its keys and values
still travel on). With attention dropout (`dropout_p` and a `seed`, dropout.py) each block's
mask comes from a generator seeded by (seed, rank, step); the backward draws it again.
Each block runs through kernels.py's kernels (torch's fused kernels on CUDA by default);
document-masked blocks run the same kernel once per document (documents.py), and blocks with
attention dropout run blocks.py's math. The next step's exchange runs while a step computes.
The forward keeps the keys and values it received (cp - 1 blocks of the rank's own size), so
the backward makes no second trip round the ring: it computes the blocks of the other ranks'
keys first, last ring step first, and sends each block's key/value gradients straight to the
rank that owns those keys while the next block computes; the block of the rank's own keys
comes last, and then the gradients that the other ranks sent are added to its own. The
gradients travel as the kernel gives them (the input's dtype from the fused kernels).
"""

from __future__ import annotations

import torch

from megadyn.core.context_parallel.blocks import merge_into
from megadyn.core.context_parallel.comm import RingExchange
from megadyn.core.context_parallel.documents import (
    device_ids,
    document_rects,
    documents_backward,
    documents_forward,
    packed,
)
from megadyn.core.context_parallel.dropout import block_dropout
from megadyn.core.context_parallel.kernels import KERNELS, block_kernels, fused_kernels
from megadyn.core.context_parallel.sequence import split_sequence


def _block_plan(step: int, origin: int, rank: int, half: int) -> tuple[slice, slice, bool]:
    """(query rows, key columns, causal) of ring step `step` holding rank `origin`'s keys."""
    everything = slice(None)
    if step == 0:
        return everything, everything, True
    if origin < rank:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


def _step_block(ring: RingExchange, step: int, half: int, document_ids, seen=None):
    """(rows, cols, causal, visible) of ring step `step`, where `visible` [b, 1, sq, sk] keeps
    the pairs of one document (None without `document_ids` [b, S]); None when nothing in the
    block is visible (`seen`: `_steps_seen`'s flags)."""
    if seen is not None and not seen[step]:  # `seen` is None without `document_ids`
        return None
    rows, cols, causal, q_doc, k_doc = _step_documents(ring, step, half, document_ids)
    if document_ids is None:
        return rows, cols, causal, None
    visible = (q_doc.unsqueeze(-1) == k_doc.unsqueeze(-2)).unsqueeze(1)  # [b, 1, sq, sk]
    return rows, cols, causal, visible


def _step_documents(ring: RingExchange, step: int, half: int, document_ids):
    """(rows, cols, causal, q_doc, k_doc) of ring step `step`: the document ids of the block's
    query rows [b, sq] and key columns [b, sk] (None without `document_ids`)."""
    origin = (ring.rank - step) % ring.size
    rows, cols, causal = _block_plan(step, origin, ring.rank, half)
    if document_ids is None:
        return rows, cols, causal, None, None
    q_doc = split_sequence(document_ids, ring.rank, ring.size, dim=1)[:, rows]
    k_doc = split_sequence(document_ids, origin, ring.size, dim=1)[:, cols]
    return rows, cols, causal, q_doc, k_doc


def _document_blocks(ring: RingExchange, half: int, host_ids) -> list:
    """Per ring step (rows, cols, visible rectangles of documents.py), None where no pair of
    the block is visible: the document-masked blocks that the fused kernels run (from the
    host copy of the document ids)."""
    blocks = []
    for step in range(ring.size):
        rows, cols, causal, q_doc, k_doc = _step_documents(ring, step, half, host_ids)
        rects = document_rects(q_doc, k_doc, causal)
        blocks.append((rows, cols, rects) if rects else None)
    return blocks


def _steps_seen(ring: RingExchange, half: int, document_ids) -> list[bool] | None:
    """Whether each ring step's block has a visible pair, read from the device once per call
    (step 0 holds every query's own key); None without `document_ids`."""
    if document_ids is None:
        return None
    later = [_step_block(ring, step, half, document_ids)[3].any() for step in range(1, ring.size)]
    return [True] + (torch.stack(later).tolist() if later else [])


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, document_ids, kernel, dropout):
        ring = RingExchange(group)
        half = q.shape[2] // 2
        documents, document_ids = document_ids, device_ids(document_ids)
        # document-masked blocks without dropout: the fused kernel per document (documents.py)
        fused = fused_kernels(q, kernel) if document_ids is not None and dropout is None else None
        if fused:  # the same in every layer: computed once per micro batch
            documents = packed(documents)
            key = ("ring", ring.rank, ring.size, half)
            docs = documents.derived(key, lambda: _document_blocks(ring, half, documents.host))
        else:
            docs = None
        masked = fused is None and (document_ids is not None or dropout is not None)
        pair = block_kernels(q, kernel, masked=masked)  # (forward, backward)
        seen = None if fused else _steps_seen(ring, half, document_ids)
        kv = torch.stack([k, v]).contiguous()  # [2, b, g, s, d]: one message per step
        held, out, lse = [], None, None  # held[j]: the keys and values of ring step j
        for step in range(ring.size):
            held.append(kv)
            if step < ring.size - 1:
                incoming, pending = ring.start(kv)
            block = _block(ring, step, half, docs, document_ids, seen)
            if block is not None:
                rows, cols = block[0], block[1]
                qb, kb, vb = q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols]
                if docs is not None:
                    block_out, block_lse = documents_forward(fused[0], qb, kb, vb, scale, block[2])
                else:
                    drop = _block_dropout(dropout, ring, step, qb, kb)
                    causal, visible = block[2], block[3]
                    block_out, block_lse = pair[0](qb, kb, vb, causal, scale, visible, drop)
                if out is None:  # step 0: [b, n, s, d], [b, n, s] in accumulation precision
                    out, lse = block_out.to(torch.promote_types(q.dtype, torch.float32)), block_lse
                else:
                    merge_into(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if step < ring.size - 1:
                ring.wait(pending)
                kv = incoming
        out = out.to(q.dtype)
        # the received keys and values are kept: the backward needs no second trip round the ring
        ctx.save_for_backward(q, out, lse, *held)
        ctx.group, ctx.scale, ctx.document_ids, ctx.pair = group, scale, document_ids, pair
        ctx.dropout, ctx.seen, ctx.fused, ctx.docs = dropout, seen, fused, docs
        return out

    @staticmethod
    def backward(ctx, dout):
        """The blocks of other ranks' keys first: each one's key/value gradients go straight
        home (to the rank that owns those keys) while the later blocks compute, and the own
        block last, so no transfer waits at the end but the one started before it."""
        q, out, lse, *held = ctx.saved_tensors
        ring = RingExchange(ctx.group)
        half = q.shape[2] // 2
        acc = torch.promote_types(q.dtype, torch.float32)
        sent_dtype = _partial_dtype(q, ctx.pair, ctx.docs, acc)
        dq = torch.zeros_like(q, dtype=acc)
        pending, partials = [], []
        for step in reversed(range(ring.size)):
            grads = _block_grads(ctx, ring, step, half, held[step], dout, q, out, lse)
            if grads is not None:
                rows, dq_b, dk_b, dv_b = grads
                dq[:, :, rows] += dq_b
            if step == 0:  # the own block: every query sees its own key, all columns
                dk, dv = dk_b.to(acc), dv_b.to(acc)
                continue
            # this block's gradients of rank `origin`'s keys and values (zeros: nothing seen)
            origin = (ring.rank - step) % ring.size
            shape = held[0][0][:, :, _block_plan(step, origin, ring.rank, half)[1]].shape
            if grads is None:
                message = [torch.zeros(shape, dtype=sent_dtype, device=q.device)] * 2
            else:  # as the kernel gave them: no copy into one message
                message = [dk_b.to(sent_dtype), dv_b.to(sent_dtype)]
            # and from the rank `step` ahead, its gradients of this rank's keys and values
            sender = (ring.rank + step) % ring.size
            cols = _block_plan(step, ring.rank, sender, half)[1]
            shape = held[0][0][:, :, cols].shape
            incoming = [torch.empty(shape, dtype=sent_dtype, device=q.device) for _ in "kv"]
            pending += ring.exchange(message, origin, incoming, sender)
            partials.append((cols, incoming))
        ring.wait(pending)
        for cols, (dk_in, dv_in) in partials:
            dk[:, :, cols] += dk_in
            dv[:, :, cols] += dv_in
        kv_dtype = held[0].dtype
        return (
            dq.to(q.dtype),
            dk.to(kv_dtype),
            dv.to(kv_dtype),
            None,
            None,
            None,
            None,
            None,
        )


def _block(ring: RingExchange, step: int, half: int, docs, document_ids, seen):
    """Ring step `step`'s block: (rows, cols, rectangles) through the per-document kernels,
    (rows, cols, causal, visible) otherwise; None when nothing in it is visible."""
    if docs is not None:
        return docs[step]
    return _step_block(ring, step, half, document_ids, seen)


def _block_grads(ctx, ring: RingExchange, step: int, half: int, kv, dout, q, out, lse):
    """(rows, dq, dk, dv) of ring step `step`'s block over the keys and values `kv` held
    there; None when nothing in it is visible."""
    block = _block(ring, step, half, ctx.docs, ctx.document_ids, ctx.seen)
    if block is None:
        return None
    rows, cols = block[0], block[1]
    qb, kb, vb = q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols]
    if ctx.docs is not None:
        grads = documents_backward(
            ctx.fused[1], dout[:, :, rows], qb, kb, vb, out[:, :, rows], lse[:, :, rows],
            ctx.scale, block[2],
        )  # fmt: skip
    else:
        drop = _block_dropout(ctx.dropout, ring, step, qb, kb)
        grads = ctx.pair[1](
            dout[:, :, rows], qb, kb, vb, out[:, :, rows], lse[:, :, rows],
            block[2], ctx.scale, block[3], drop,
        )  # fmt: skip
    return (rows, *grads)


def _partial_dtype(q, pair, docs, acc) -> torch.dtype:
    """The dtype of a block's key/value gradients, as every rank computes it: the input's
    from the fused kernels, the accumulation precision from the math and per-document paths
    (they sum several calls): so a rank sends them as they are and knows what it receives."""
    if docs is not None or pair is KERNELS["math"]:
        return acc
    return q.dtype


def _block_dropout(dropout, ring: RingExchange, step: int, q, k):
    """The dropout scale of ring step `step`'s block of queries q and keys k (None: none)."""
    if dropout is None:
        return None
    p, seed = dropout
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])  # [b, n, sq, sk]
    return block_dropout(seed, p, ring.rank, step, shape, q.device)


def ring_attention(
    q,
    k,
    v,
    group,
    scale: float | None = None,
    document_ids=None,
    kernel: str | None = None,
    dropout: tuple[float, int] | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries q [b, n, s, d] over the whole sequence, whose
    keys and values k, v [b, g, s, d] are spread over `group` (the cp group); within
    documents when `document_ids` [b, S] (the whole sequence's; or documents.py's
    PackedDocuments) is given, with attention
    dropout when `dropout` is (p, seed) (dropout.py). Each block runs through kernels.py's
    `kernel` ("flash", "cudnn", "math"; None: kernels.py's pick; math under dropout)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, group, scale, document_ids, kernel, dropout)
