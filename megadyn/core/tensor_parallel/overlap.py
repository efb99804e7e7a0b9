"""Sequence-parallel linear layers whose collectives are ring exchanges overlapped with GEMMs.

Opt-in (`GPTConfig.tp_comm_overlap`, under sequence parallelism); the plain path is
`gather_from_sequence` + `F.linear` + `reduce_scatter_to_sequence` (mappings.py).

Activations are [s, b, h] with the sequence first, so rank r's sequence chunk is the row block
r of the 2-D view [s*b, h]. Each all-gather or reduce-scatter along the sequence is split into
tp - 1 point-to-point steps around the ring of the tp group (send to rank r+1, receive from
rank r-1; at tp = 2 one exchange with the peer), and each step's transfer runs while the GEMM
of another chunk is computed ("collective matmul"):

    ring all-gather      at step k, multiply the chunk held (r - k) while sending it on and
                         receiving the next one
    ring reduce-scatter  at step k, multiply the partial sum of chunk (r - k - 1), add the
                         accumulator received from rank r-1 and send it on to rank r+1; the
                         last step is this rank's own chunk

Column-parallel (input [s/tp, b, in] per rank, output [s, b, out/tp]):
    forward   ring all-gather of the input, the gathered input [s, b, in] kept for backward
    backward  ring reduce-scatter of the input gradient [s, b, in] fused with its GEMM; the
              weight-gradient GEMM runs during the last exchange
Row-parallel (input [s, b, in/tp], output [s/tp, b, out], bias added by the caller):
    forward   ring reduce-scatter of the output fused with its GEMM
    backward  ring all-gather of the output gradient, the input gradient's GEMM per chunk

The ring reduce-scatter adds the partial sums in ring order, so results equal the plain
path's up to float rounding. Weight gradients go into `main_grad` as in layers.py (wgrad.py).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from megadyn.core.tensor_parallel.mappings import group_rank, group_size
from megadyn.core.tensor_parallel.wgrad import weight_grad

ChunkGemm = Callable[[int, torch.Tensor], object]
"""`gemm(c, out)` writes the GEMM result of sequence chunk c into `out` ([s/tp * b, d])."""


def _rows(t2d: torch.Tensor, chunk: int, rows: int) -> torch.Tensor:
    return t2d[chunk * rows : (chunk + 1) * rows]  # sequence chunk `chunk` of [s*b, d]


def _ring_exchange(send: torch.Tensor, recv: torch.Tensor, group) -> list:
    """Start sending `send` to the next rank of the ring and receiving `recv` from the previous."""
    tp, rank = group_size(group), group_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % tp)
    prev = dist.get_global_rank(group, (rank - 1) % tp)
    return dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, send, nxt, group),
            dist.P2POp(dist.irecv, recv, prev, group),
        ]
    )


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def ring_all_gather_gemm(
    local2d: torch.Tensor, full2d: torch.Tensor, gemm: ChunkGemm, group
) -> None:
    """All-gather `local2d` [rows, d] into `full2d` [tp * rows, d] around the ring, calling
    `gemm(c, full2d chunk c)` on each chunk while the next one is in flight."""
    tp, rank = group_size(group), group_rank(group)
    rows = local2d.shape[0]
    _rows(full2d, rank, rows).copy_(local2d)
    for k in range(tp):
        held = (rank - k) % tp
        works = []
        if k < tp - 1:  # pass the held chunk on, receive the one rank r-1 held
            works = _ring_exchange(
                _rows(full2d, held, rows), _rows(full2d, (held - 1) % tp, rows), group
            )
        gemm(held, _rows(full2d, held, rows))
        _wait(works)


def ring_gemm_reduce_scatter(
    gemm: ChunkGemm, out2d: torch.Tensor, group, during_last: Callable[[], object] | None = None
) -> object:
    """out2d [rows, d] = sum over the ring of every rank's `gemm(r, .)` for this rank r: the
    partial sums of the other chunks travel around the ring while the next one is computed.
    `during_last()` runs after the last GEMM, while the last exchange is still in flight; its
    result is returned."""
    tp, rank = group_size(group), group_rank(group)
    recv = torch.empty_like(out2d)  # accumulator from rank r-1
    partials = [torch.empty_like(out2d) for _ in range(min(2, tp - 1))]  # one may be in flight
    works, result = [], None
    for k in range(tp):
        chunk = (rank - k - 1) % tp  # the last step (k = tp - 1) is this rank's own chunk
        part = out2d if k == tp - 1 else partials[k % 2]
        gemm(chunk, part)
        if k == tp - 1 and during_last is not None:
            result = during_last()
        if k > 0:
            _wait(works)
            part.add_(recv)
        if k < tp - 1:
            works = _ring_exchange(part, recv, group)
    return result


class _ColumnSequenceParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, fuse):
        tp = group_size(group)
        x = x.contiguous()
        s_l, b, d_in = x.shape
        rows, d_out = s_l * b, weight.shape[0]
        gathered = torch.empty((tp * s_l, b, d_in), dtype=x.dtype, device=x.device)  # [s, b, in]
        y = torch.empty((tp * s_l, b, d_out), dtype=x.dtype, device=x.device)  # [s, b, out/tp]
        y2d = y.view(tp * rows, d_out)

        def gemm(c, x_chunk):  # [rows, in] -> rows of y
            if bias is None:
                torch.mm(x_chunk, weight.t(), out=_rows(y2d, c, rows))
            else:
                torch.addmm(bias, x_chunk, weight.t(), out=_rows(y2d, c, rows))

        ring_all_gather_gemm(x.view(rows, d_in), gathered.view(tp * rows, d_in), gemm, group)
        ctx.save_for_backward(gathered, weight)
        ctx.group, ctx.fuse, ctx.has_bias = group, fuse, bias is not None
        return y

    @staticmethod
    def backward(ctx, g):
        gathered, weight = ctx.saved_tensors
        tp = group_size(ctx.group)
        g2d = g.contiguous().view(-1, g.shape[-1])  # [s*b, out/tp]
        x2d = gathered.view(-1, gathered.shape[-1])  # [s*b, in]
        rows = g2d.shape[0] // tp

        def wgrad():
            return weight_grad(weight, g2d, x2d, ctx.fuse) if ctx.needs_input_grad[1] else None

        grad_x = None
        if ctx.needs_input_grad[0]:
            s_l = gathered.shape[0] // tp
            grad_x = torch.empty((s_l,) + gathered.shape[1:], dtype=g.dtype, device=g.device)
            grad_w = ring_gemm_reduce_scatter(  # grad_x [s/tp, b, in]
                lambda c, part: torch.mm(_rows(g2d, c, rows), weight, out=part),
                grad_x.view(rows, -1),
                ctx.group,
                during_last=wgrad,
            )
        else:
            grad_w = wgrad()
        grad_b = g2d.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None


class _RowSequenceParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, fuse):
        tp = group_size(group)
        x = x.contiguous()
        s, b, d_in = x.shape
        if s % tp:
            raise ValueError(f"sequence length {s} is not divisible by tp {tp}")
        x2d = x.view(s * b, d_in)
        rows, d_out = s * b // tp, weight.shape[0]
        out = torch.empty((s // tp, b, d_out), dtype=x.dtype, device=x.device)  # [s/tp, b, out]
        ring_gemm_reduce_scatter(
            lambda c, part: torch.mm(_rows(x2d, c, rows), weight.t(), out=part),
            out.view(rows, d_out),
            group,
        )
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.fuse = group, fuse
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        tp = group_size(ctx.group)
        g = g.contiguous()  # [s/tp, b, out]
        s_l, b, d_out = g.shape
        rows, d_in = s_l * b, weight.shape[1]
        g_full = torch.empty((tp * s_l, b, d_out), dtype=g.dtype, device=g.device)  # [s, b, out]
        gf2d = g_full.view(tp * rows, d_out)
        grad_x, gx2d = None, None
        if ctx.needs_input_grad[0]:
            grad_x = torch.empty((tp * s_l, b, d_in), dtype=g.dtype, device=g.device)
            gx2d = grad_x.view(tp * rows, d_in)  # [s*b, in/tp]

        def gemm(c, g_chunk):  # [rows, out] -> rows c of grad_x
            if gx2d is not None:
                torch.mm(g_chunk, weight, out=_rows(gx2d, c, rows))

        ring_all_gather_gemm(g.view(rows, d_out), gf2d, gemm, ctx.group)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad(weight, gf2d, x.view(tp * rows, d_in), ctx.fuse)
        return grad_x, grad_w, None, None


def column_sequence_parallel_linear(x, weight, bias, group, fuse: bool):
    """[s/tp, b, in] -> [s, b, out/tp]: ring all-gather overlapped with the chunk GEMMs."""
    return _ColumnSequenceParallelLinear.apply(x, weight, bias, group, fuse)


def row_sequence_parallel_linear(x, weight, group, fuse: bool):
    """[s, b, in/tp] -> [s/tp, b, out] (ring reduce-scattered with the chunk GEMMs; no bias)."""
    return _RowSequenceParallelLinear.apply(x, weight, group, fuse)
