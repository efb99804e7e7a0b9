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

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megadyn.core.context_parallel.documents import packed
from megadyn.core.context_parallel.placement import BlockPlacement
from megadyn.core.context_parallel.varlen import (
    VarlenPlan,
    varlen_backward,
    varlen_forward,
)


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


def _positions(blocks, n: int) -> torch.Tensor:
    """Sequence positions of `blocks` of n tokens, in the blocks' order."""
    return torch.cat([torch.arange(k * n, (k + 1) * n) for k in blocks])


@dataclass(frozen=True)
class _Part:
    """One varlen call: its segments and the rows of the rank's queries (token order,
    flattened over the micro batch's samples) they cover, in the call's order."""

    plan: VarlenPlan
    rows: torch.Tensor


@dataclass(frozen=True)
class _Route:
    """What one rank's attention derives from the placement: the same in every layer, so
    derived once per micro batch (BlockPlacement.derived)."""

    seq: int
    own: torch.Tensor
    """Sequence positions of the rank's tokens, in its local order."""
    sends: dict
    """{peer: local rows of the rank's blocks that peer reads}."""
    receives: dict
    """{peer: sequence positions of the blocks received from it}."""
    parts: tuple
    """(segments on the rank's own keys, the rest): _Part or None each; the first call runs
    while the received blocks are in flight."""


def _segments(placement: BlockPlacement, rank: int, ids: torch.Tensor):
    """(sample row, first local row, end local row, first key, end key) of each of `rank`'s
    runs of query tokens consecutive in the sequence and of one document; its keys run from
    that document's start to the run's end. `ids` [b, S] on the host."""
    seq = ids.shape[1]
    pos = placement.token_index(rank)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    doc_start = torch.where(starts, torch.arange(seq), 0).cummax(-1).values  # [b, S]
    for row in range(ids.shape[0]):
        mine = ids[row, pos]
        cut = torch.ones(pos.numel(), dtype=torch.bool)
        cut[1:] = (pos[1:] != pos[:-1] + 1) | (mine[1:] != mine[:-1])
        bounds = cut.nonzero().flatten().tolist() + [pos.numel()]
        for a, e in zip(bounds, bounds[1:]):
            yield row, a, e, doc_start[row, pos[a]].item(), pos[e - 1].item() + 1


def _route(placement: BlockPlacement, rank: int, ids, batch: int, device) -> _Route:
    """The rank's route (see _Route); `ids` [b, S] on the host, or None (one document)."""
    n = placement.block_size
    seq, local = placement.kinds.shape[0] * n, placement.token_index(rank).numel()
    if ids is None:
        ids = torch.zeros(batch, seq, dtype=torch.long)
    own = set(placement.blocks[rank])
    split = ([], []), ([], [])  # per part: (segments, their query rows)
    for row, a, e, first, last in _segments(placement, rank, ids):
        remote = any(k not in own for k in range(first // n, (last - 1) // n + 1))
        split[remote][0].append((e - a, last - first, row * seq + first))
        split[remote][1].append(torch.arange(row * local + a, row * local + e))
    parts = []
    for segments, rows in split:
        if not segments:
            parts.append(None)
            continue
        keys = torch.cat([torch.arange(f, f + lk) for _, lk, f in segments])
        plan = VarlenPlan.build([s[0] for s in segments], [s[1] for s in segments], keys, device)
        parts.append(_Part(plan, torch.cat(rows).to(device)))
    sends, receives = _exchange_plan(placement, rank)
    slot = {k: i for i, k in enumerate(placement.blocks[rank])}
    return _Route(
        seq,
        placement.token_index(rank, device),
        {p: _positions([slot[k] for k in blocks], n).to(device) for p, blocks in sends.items()},
        {p: _positions(blocks, n).to(device) for p, blocks in receives.items()},
        tuple(parts),
    )


def _start(group, messages: dict, buffers: dict) -> list:
    """Send `messages` and receive into `buffers` ({peer: tensor} each); pending work."""
    ops = [
        dist.P2POp(dist.isend, m, dist.get_global_rank(group, p), group)
        for p, m in messages.items()
    ]
    ops += [
        dist.P2POp(dist.irecv, b, dist.get_global_rank(group, p), group) for p, b in buffers.items()
    ]
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(pending: list) -> None:
    for work in pending:
        work.wait()


def _blocks_of(x: torch.Tensor, dim: int, index: torch.Tensor, dtype=None) -> torch.Tensor:
    """A contiguous message of x's entries at `index` along `dim` (one copy)."""
    return x.index_select(dim, index).to(dtype or x.dtype, memory_format=torch.contiguous_format)


def _empty_blocks(kv: torch.Tensor, tokens: int) -> torch.Tensor:
    """A buffer like kv [2, b, g, s, d] for `tokens` tokens."""
    return kv.new_empty(kv.shape[:3] + (tokens,) + kv.shape[4:])


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """[b, n, s, d] -> [b * s, n, d] (a view where x is a transposed [b, s, n, d])."""
    b, n, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, n, d)


def _fill(whole: torch.Tensor, positions: torch.Tensor, blocks: torch.Tensor) -> None:
    """Put blocks [2, b, g, s', d] at sequence `positions` [s'] of whole [2, b, S, g, d]."""
    whole.index_copy_(2, positions, blocks.transpose(2, 3))


class _DynamicAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, placement, document_ids, scale, kernel):
        rank, (b, heads, s, d) = dist.get_rank(group), q.shape
        key = ("route", rank, b, q.device)  # the same in every layer: once per micro batch
        if key not in placement.derived:
            host = None if document_ids is None else packed(document_ids).host
            placement.derived[key] = _route(placement, rank, host, b, q.device)
        route = placement.derived[key]
        kv = torch.stack([k, v])  # [2, b, g, s, d]
        received = {p: _empty_blocks(kv, len(i)) for p, i in route.receives.items()}
        messages = {p: _blocks_of(kv, 3, rows) for p, rows in route.sends.items()}
        pending = _start(group, messages, received)
        whole = kv.new_empty(2, b, route.seq, k.shape[1], d)
        _fill(whole, route.own, kv)
        qt, out = _tokens_first(q), torch.empty(b * s, heads, d, dtype=q.dtype, device=q.device)
        saved = []
        for i, part in enumerate(route.parts):  # own keys first, the received ones in flight
            if i == 1:
                _wait(pending)
                for p, positions in route.receives.items():
                    _fill(whole, positions, received[p])
            if part is None:
                saved.append(())
            else:
                flat = whole.view(2, b * route.seq, -1, d)
                keys, values = flat.index_select(1, part.plan.key_index)
                o, aux = varlen_forward(qt[part.rows], keys, values, part.plan, scale, kernel)
                out.index_copy_(0, part.rows, o)
                saved.append((o, *aux))
        ctx.save_for_backward(q, k, v, *(t for x in saved for t in x), *received.values())
        ctx.counts = [len(x) for x in saved]
        ctx.n_saved, ctx.route, ctx.group = sum(ctx.counts), route, group
        ctx.scale, ctx.kernel = scale, kernel
        return out.view(b, s, heads, d).transpose(1, 2)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, *rest = ctx.saved_tensors
        route, group, (b, heads, s, d) = ctx.route, ctx.group, q.shape
        saved, received = rest[: ctx.n_saved], dict(zip(route.receives, rest[ctx.n_saved :]))
        kv = torch.stack([k, v])
        whole = kv.new_empty(2, b, route.seq, k.shape[1], d)
        _fill(whole, route.own, kv)
        for p, positions in route.receives.items():
            _fill(whole, positions, received[p])
        whole = whole.view(2, b * route.seq, -1, d)
        acc = torch.promote_types(q.dtype, torch.float32)
        dwhole = torch.zeros(whole.shape, dtype=acc, device=q.device)
        qt, dout_t = _tokens_first(q), _tokens_first(dout)
        dq = torch.empty_like(qt)
        per_part, at = [], 0
        for count in ctx.counts:  # each part's (output, aux...) as the forward saved them
            per_part.append(saved[at : at + count])
            at += count
        pending, returned = [], {}
        for i in (1, 0):  # the received keys' gradients go home while the own part runs
            part = route.parts[i]
            if part is not None:
                o, *aux = per_part[i]
                keys, values = whole.index_select(1, part.plan.key_index)
                rows, plan = part.rows, part.plan
                dq_p, dk_p, dv_p = varlen_backward(
                    dout_t[rows], qt[rows], keys, values, o, aux, plan, ctx.scale, ctx.kernel
                )
                dq.index_copy_(0, rows, dq_p)
                dwhole[0].index_add_(0, plan.key_index, dk_p.to(acc))
                dwhole[1].index_add_(0, plan.key_index, dv_p.to(acc))
            if i == 1:
                grads = dwhole.view(2, b, route.seq, -1, d)
                messages = {  # in the inputs' dtype, as the ring sends them
                    p: _blocks_of(grads.transpose(2, 3), 3, index, k.dtype)
                    for p, index in route.receives.items()
                }
                returned = {p: _empty_blocks(kv, len(r)) for p, r in route.sends.items()}
                pending = _start(group, messages, returned)
        dkv = dwhole.view(2, b, route.seq, -1, d).index_select(2, route.own).transpose(2, 3)
        dkv = dkv.contiguous()
        _wait(pending)
        for p, rows in route.sends.items():
            dkv.index_add_(3, rows, returned[p].to(acc))
        dq = dq.view(b, s, heads, d).transpose(1, 2)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def dynamic_attention(
    q, k, v, group, placement: BlockPlacement, document_ids=None, scale=None, kernel=None
) -> torch.Tensor:
    """Causal attention (within documents when `document_ids` [b, S], the whole sequence's,
    or documents.py's PackedDocuments, is given) of this rank's queries q [b, n, s, d] over
    the whole sequence, whose blocks of keys and values k, v [b, g, s, d] are spread over
    `group` as `placement` says."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _DynamicAttention.apply(q, k, v, group, placement, document_ids, scale, kernel)
