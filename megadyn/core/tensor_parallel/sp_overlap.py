"""Sequence-parallel GEMMs that run beside their all-gathers (--tp-comm-overlap, opt-in).

Under sequence parallelism a column-parallel layer all-gathers its input [s/tp, b, in] along the
sequence before its GEMM, and a row-parallel layer reduce-scatters its output (and all-gathers
its output gradient in the backward pass). Here the GEMM is split by sequence chunk so that the
transfer runs beside the chunk that does not need it:

    all_gather_linear       the own chunk's rows are multiplied while the all-gather runs,
                            then the other chunks' rows
    linear_reduce_scatter   tp = 2: the peer's chunk is multiplied first and its partial sum
                            sent (an all-gather of one chunk) while the own chunk is
                            multiplied, then the two are added; tp > 2: GEMM, reduce-scatter
    _RowSequenceOverlap     the row-parallel layer: linear_reduce_scatter forward; backward,
                            the own chunk's input and weight gradients while the output
                            gradient is all-gathered, then the other chunks'

The transfers are collectives, so a CUDA graph captures them (cuda_graph.py), through one of two
transports (--tp-comm-overlap-transport):

    nccl          NCCL kernels; they take multiprocessors, and a GEMM that has them all
                  delays the collective beside it
    copy-engine   the copy engines, through torch's symmetric memory (the all-gathers; at
                  tp = 2 also the reduce-scatters, as an all-gather of the peer's rows), so
                  the GEMMs keep every multiprocessor. The barriers are torch's private
                  symmetric-memory API (_copy_engine_all_gather); the workspace and the side
                  stream are the layout's (`groups.comm`, megadyn/core/comm_resources.py).
                  torch's own reduce-scatter op of that family is not used: its output is
                  memory of its side stream, and its results are wrong under a CUDA graph.
                  Its host work per transfer is larger than NCCL's: it is for graphed steps

Chunks are rows of the [s * b, d] view: the sequence is the leading dimension.
Results equal the plain path's up to float rounding (tests/core/test_tp_overlap.py).
Measurements of both transports, and what was tried before them: BENCHMARKS.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megadyn.core import c10d_compat
from megadyn.core.comm_resources import (
    CommOverlap,
    CommResources,
    resources_of,
    transport_of,
)
from megadyn.core.distributed.comm import all_gather_flat
from megadyn.core.tensor_parallel.mappings import group_rank, group_size, reduce_scatter_sequence
from megadyn.core.tensor_parallel.wgrad import weight_grad

Overlap = str | CommOverlap  # a layer's comm_overlap: the transport's name, or with its resources


def _mm_rows(a, b, out, bias=None) -> None:
    """out = a b (+ bias), written in place into rows of a larger output; no rows, no GEMM."""
    if a.shape[0] == 0:
        return
    if bias is None:
        torch.mm(a, b, out=out)
    else:
        torch.addmm(bias, a, b, out=out)


def _copy_engine(x: torch.Tensor, transport: Overlap) -> bool:
    """Whether the transfer goes through the copy engines (torch's symmetric memory: no
    multiprocessors taken from the GEMMs beside it) rather than NCCL kernels."""
    if transport_of(transport) != "copy-engine":
        return False
    if not x.is_cuda:
        raise ValueError("--tp-comm-overlap-transport copy-engine needs CUDA tensors")
    c10d_compat.symmetric_memory()  # registers the op's CUDA side

    return True


def _copy_engine_all_gather(x: torch.Tensor, group, resources: CommResources):
    """All-gather through the copy engines, the entry barrier on the compute stream.

    torch's low-contention all-gather puts both its barriers (small kernels) on its side
    stream, where the entry barrier can wait for a GEMM that holds every multiprocessor, so the
    copies start only after the GEMM they were meant to run beside. Here the entry barrier runs
    on the compute stream before that GEMM is queued; the peer copies (copy engines, no
    multiprocessors) then run beside it, and the exit barrier (no rank writes its workspace
    while a peer still reads it) waits on the side stream. `wait` must come before this
    group's next all-gather. The workspace and the side stream are the layout's `resources`."""
    hdl, bufs = resources.workspace_buffers(x, group)
    rank = hdl.rank
    out = x.new_empty((len(bufs) * x.shape[0],) + x.shape[1:])
    chunks = out.chunk(len(bufs))
    bufs[rank].copy_(x)
    hdl.barrier()
    compute = torch.cuda.current_stream(x.device)
    side = resources.side_stream(x.device)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        chunks[rank].copy_(x)
        for peer, buf in enumerate(bufs):
            if peer != rank:
                chunks[peer].copy_(buf)
        hdl.barrier()
    return out, lambda: compute.wait_stream(side)


def _all_gather_start(x: torch.Tensor, group, transport: Overlap):
    """Start gathering x [n, ...] from every rank into [tp * n, ...]; (output, wait)."""
    x = x.contiguous()
    if _copy_engine(x, transport):
        return _copy_engine_all_gather(x, group, resources_of(transport, group))
    out = x.new_empty((group_size(group) * x.shape[0],) + x.shape[1:])
    work = all_gather_flat(out, x, group, async_op=True)
    return out, work.wait


def _reduce_scatter_by_gather(x: torch.Tensor, group, transport: Overlap):
    """tp = 2: each rank sends its partial of the peer's rows (an all-gather) and adds the
    peer's partial of its own rows; returns `finish`, which waits and returns the sum."""
    x = x.contiguous()
    rank, n = group_rank(group), x.shape[0] // 2
    received, wait = _all_gather_start(x[(1 - rank) * n : (2 - rank) * n], group, transport)

    def finish():
        wait()
        return x[rank * n : (rank + 1) * n] + received[(1 - rank) * n : (2 - rank) * n]

    return finish


def reduce_scatter_start(x: torch.Tensor, group, transport: Overlap):
    """Start reducing partial sums x [tp * n, ...] into this rank's [n, ...]; returns `finish`,
    which waits and returns the result (through the copy engines at tp = 2)."""
    if group_size(group) == 2 and _copy_engine(x, transport):
        return _reduce_scatter_by_gather(x, group, transport)
    out, work = reduce_scatter_sequence(x, group, async_op=True)

    def finish():
        if work is not None:
            work.wait()
        return out

    return finish


def all_gather_linear(
    x, weight, bias, group, transport: Overlap
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x gathered along the sequence [s, b, in], F.linear of it [s, b, out]) from this rank's
    x [s/tp, b, in]; the own chunk's GEMM runs while the all-gather is in flight."""
    rank = group_rank(group)
    x = x.contiguous()
    full, wait = _all_gather_start(x, group, transport)
    y = x.new_empty(full.shape[:-1] + (weight.shape[0],))
    full2d, y2d = full.view(-1, full.shape[-1]), y.view(-1, y.shape[-1])
    n = x.numel() // x.shape[-1]  # token rows per chunk
    lo, hi = rank * n, (rank + 1) * n
    _mm_rows(x.view(n, -1), weight.t(), y2d[lo:hi], bias)
    wait()
    _mm_rows(full2d[:lo], weight.t(), y2d[:lo], bias)
    _mm_rows(full2d[hi:], weight.t(), y2d[hi:], bias)
    return full, y


def linear_reduce_scatter(x, weight, group, transport: Overlap) -> torch.Tensor:
    """F.linear(x, weight) [s, b, out] (a partial sum over tp) reduce-scattered along the
    sequence to [s/tp, b, out]; at tp = 2 the GEMMs run beside the exchange."""
    tp, rank = group_size(group), group_rank(group)
    if tp != 2:
        return reduce_scatter_sequence(F.linear(x, weight), group)
    x2d = x.reshape(-1, x.shape[-1])
    n, peer = x2d.shape[0] // 2, 1 - rank
    part = torch.mm(x2d[peer * n : (peer + 1) * n], weight.t())  # the peer's rows: its partial
    received, wait = _all_gather_start(part, group, transport)  # [rank 0's part; rank 1's part]
    own = torch.mm(x2d[rank * n : (rank + 1) * n], weight.t())
    wait()
    own += received[peer * n : (peer + 1) * n]  # the peer's partial sum of this rank's rows
    return own.view((x.shape[0] // 2,) + x.shape[1:-1] + (weight.shape[0],))


class _RowSequenceOverlap(torch.autograd.Function):
    """Row-parallel y [s/tp, b, out] = reduce-scatter(x W^T) from x [s, b, in/tp]."""

    @staticmethod
    def forward(ctx, x, weight, group, fuse, transport):
        ctx.save_for_backward(x, weight)
        ctx.weight = weight  # the parameter (its main_grad): see _LinearAsyncReduce.forward
        ctx.group, ctx.fuse, ctx.transport = group, fuse, transport
        return linear_reduce_scatter(x, weight, group, transport)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        group = ctx.group
        tp, rank = group_size(group), group_rank(group)
        g = g.contiguous()  # [s/tp, b, out]
        g_full, wait = _all_gather_start(g, group, ctx.transport)  # [s, b, out]
        n = g.numel() // g.shape[-1]
        own = slice(rank * n, (rank + 1) * n)
        others = (slice(0, rank * n), slice((rank + 1) * n, tp * n))
        x2d, g_own = x.reshape(-1, x.shape[-1]), g.view(n, -1)
        grad_x = gx2d = grad_w = None
        # the own rows' input and weight gradients beside the gather, then the other rows'
        if ctx.needs_input_grad[0]:
            grad_x = x.new_empty(x.shape)  # [s, b, in/tp]
            gx2d = grad_x.view(-1, grad_x.shape[-1])
            _mm_rows(g_own, weight, gx2d[own])
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad(ctx.weight, g_own, x2d[own], ctx.fuse)
        wait()
        gf2d = g_full.view(-1, g_full.shape[-1])
        for rows in others:
            if gx2d is not None:
                _mm_rows(gf2d[rows], weight, gx2d[rows])
            if grad_w is not None and rows.stop > rows.start:
                part = weight_grad(ctx.weight, gf2d[rows], x2d[rows], ctx.fuse)
                grad_w = grad_w if ctx.fuse else grad_w + part  # fused: added to main_grad
        return grad_x, grad_w, None, None, None


def row_parallel_overlap(x, weight, group, fuse: bool, transport: Overlap) -> torch.Tensor:
    """The row-parallel layer's GEMM and reduce-scatter under sequence parallelism, overlapped."""
    return _RowSequenceOverlap.apply(x, weight, group, fuse, transport)
