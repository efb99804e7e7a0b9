"""Attention under a dynamic placement (--cp-placement dynamic, placement.py): each cp rank
receives only the key/value blocks its queries read from the ranks that hold them, and
computes its queries' attention in varlen kernel calls (varlen.py). On CUDA in 16-bit with
--attention-backend auto it is flex.py's one flex_attention call over the gathered keys
instead.

    out = dynamic_attention(q, k, v, cp_group, placement)   # q [b, n, s, d]

The rank's queries are cut into segments (route.py): runs of tokens consecutive in the
sequence and of one document, each over its document's keys from the start to the run's end
(causal within documents under --reset-attention-mask; over the whole sequence without
document ids). The segments on the rank's own keys are one call, made while the needed blocks
of other ranks are in flight (one message per pair of ranks that need anything from each
other); the rest are a second call once they arrive. Their keys are packed segment after
segment (a key that several segments read is copied into each).

The received blocks are kept for the backward, which repacks the keys, computes the second
call's gradients first and sends those of received keys back to their owners (in the inputs'
dtype) while the first call's run, summing each packed key's gradients at its position in
fp32.

--cp-placement static_blocks runs the static split's blocks through the same path: the
comparison point of the placement alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megadyn.core.context_parallel.comm import exchange, wait
from megadyn.core.context_parallel.flex import flex_placement_attention, uses_flex
from megadyn.core.context_parallel.placement import BlockPlacement
from megadyn.core.context_parallel.route import Route, derive_route, put, take
from megadyn.core.context_parallel.varlen import varlen_backward, varlen_forward


def _one_each(tensors: dict) -> dict:
    """{peer: tensor} as comm.exchange takes it ({peer: [tensors]})."""
    return {p: [t] for p, t in tensors.items()}


def _tokens(runs) -> int:
    return sum(n for _, n in runs)


def _empty_blocks(kv: torch.Tensor, runs) -> torch.Tensor:
    """A buffer like kv [2, b, g, s, d] for the tokens of `runs`."""
    return kv.new_empty(kv.shape[:3] + (_tokens(runs),) + kv.shape[4:])


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """[b, n, s, d] -> [b * s, n, d] (a view where x is a transposed [b, s, n, d])."""
    b, n, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, n, d)


def _whole(kv: torch.Tensor, route: Route, received: dict | None) -> torch.Tensor:
    """[2, b, S, g, d]: the rank's keys and values (kv [2, b, g, s, d]) at their sequence
    positions, and the received blocks at theirs (when given); the rest is never read."""
    _, b, g, _, d = kv.shape
    whole = kv.new_empty(2, b, route.seq, g, d)
    put(whole, 2, route.own, kv.transpose(2, 3))
    if received is not None:
        _fill_received(whole, route, received)
    return whole


def _fill_received(whole: torch.Tensor, route: Route, received: dict) -> None:
    for p, runs in route.receives.items():
        put(whole, 2, runs, received[p].transpose(2, 3))


class _DynamicAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, placement, scale, kernel):
        rank, (b, heads, s, d) = dist.get_rank(group), q.shape
        key = ("route", rank, b, q.device)  # the same in every layer: once per micro batch
        if key not in placement.derived:
            ids = placement.document_ids  # on the host: no read from the device
            placement.derived[key] = derive_route(placement, rank, ids, b, q.device)
        route = placement.derived[key]
        kv = torch.stack([k, v])  # [2, b, g, s, d]
        received = {p: _empty_blocks(kv, runs) for p, runs in route.receives.items()}
        messages = {p: take(kv, 3, runs) for p, runs in route.sends.items()}
        pending = exchange(group, _one_each(messages), _one_each(received))
        whole = _whole(kv, route, None)
        qt, out = _tokens_first(q), q.new_empty(b * s, heads, d)
        saved = []
        for i, part in enumerate(route.parts):  # own keys first, the received ones in flight
            if i == 1:
                wait(pending)
                _fill_received(whole, route, received)
            if part is None:
                saved.append(())
                continue
            keys, values = take(whole.view(2, b * route.seq, -1, d), 1, part.keys)
            o, aux = varlen_forward(take(qt, 0, part.rows), keys, values, part.plan, scale, kernel)
            put(out, 0, part.rows, o)
            saved.append(aux)
        ctx.save_for_backward(q, k, v, out, *(t for x in saved for t in x), *received.values())
        ctx.counts, ctx.route, ctx.group = [len(x) for x in saved], route, group
        ctx.scale, ctx.kernel = scale, kernel
        return out.view(b, s, heads, d).transpose(1, 2)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, *rest = ctx.saved_tensors
        route, group, (b, heads, s, d) = ctx.route, ctx.group, q.shape
        per_part, at = [], 0
        for count in ctx.counts:  # each part's kernel state as the forward saved it
            per_part.append(rest[at : at + count])
            at += count
        received = dict(zip(route.receives, rest[at:]))
        kv = torch.stack([k, v])
        whole = _whole(kv, route, received).view(2, b * route.seq, -1, d)
        acc = torch.promote_types(q.dtype, torch.float32)
        dwhole = torch.zeros(whole.shape, dtype=acc, device=q.device)  # [2, b * S, g, d]
        qt, dout_t = _tokens_first(q), _tokens_first(dout)
        dq = torch.empty_like(qt)
        pending, returned = [], {}
        for i in (1, 0):  # the received keys' gradients go home while the own part runs
            part = route.parts[i]
            if part is not None:
                keys, values = take(whole, 1, part.keys)
                rows = part.rows
                dq_p, dk_p, dv_p = varlen_backward(
                    take(dout_t, 0, rows), take(qt, 0, rows), keys, values, take(out, 0, rows),
                    per_part[i], part.plan, ctx.scale, ctx.kernel,
                )  # fmt: skip
                put(dq, 0, part.rows, dq_p)
                put(dwhole[0], 0, part.keys, dk_p, add=True)
                put(dwhole[1], 0, part.keys, dv_p, add=True)
            if i == 1:
                grads = dwhole.view(2, b, route.seq, -1, d).transpose(2, 3)  # [2, b, g, S, d]
                messages = {  # in the inputs' dtype, as the ring sends them
                    p: take(grads, 3, runs).to(k.dtype) for p, runs in route.receives.items()
                }
                returned = {p: _empty_blocks(kv, runs) for p, runs in route.sends.items()}
                pending = exchange(group, _one_each(messages), _one_each(returned))
        dkv = take(dwhole.view(2, b, route.seq, -1, d), 2, route.own).transpose(2, 3)
        dkv = dkv.contiguous()
        wait(pending)
        for p, runs in route.sends.items():
            put(dkv, 3, runs, returned[p], add=True)
        dq = dq.view(b, s, heads, d).transpose(1, 2)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def dynamic_attention(q, k, v, group, placement: BlockPlacement, scale=None, kernel=None):
    """Causal attention of this rank's queries q [b, n, s, d] over the whole sequence (within
    documents when the placement was computed from document ids), whose blocks of keys and
    values k, v [b, g, s, d] are spread over `group` as `placement` says."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if uses_flex(q, kernel, placement.block_size):  # CUDA, 16-bit, --attention-backend auto
        return flex_placement_attention(q, k, v, group, placement, scale)
    return _DynamicAttention.apply(q, k, v, group, placement, scale, kernel)
