"""Sequence-parallel linear layers whose all-gather / reduce-scatter overlap their GEMMs.

Opt-in (`GPTConfig.tp_comm_overlap`); the plain path is `gather_from_sequence` + `F.linear`.

Column-parallel (input [s/tp, b, in] per rank, output [s, b, out/tp]):
    forward   the all-gather of the input runs while this rank's own sequence chunk is
              multiplied; the other chunks follow once it lands
    backward  the input gradient [s, b, in] is reduce-scattered while the weight gradient
              GEMM runs
Row-parallel (input [s, b, in/tp], output [s/tp, b, out]):
    backward  the all-gather of the output gradient runs while the input gradient of this
              rank's own chunk is computed

Both accumulate weight gradients into `main_grad` as layers.py does (wgrad.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megadyn.core.tensor_parallel.mappings import group_rank, group_size
from megadyn.core.tensor_parallel.wgrad import weight_grad


def _matmul_into(out2d, x2d, weight, bias):
    if bias is None:
        torch.mm(x2d, weight.t(), out=out2d)
    else:
        torch.addmm(bias, x2d, weight.t(), out=out2d)


class _ColumnSequenceParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, fuse):
        tp, rank = group_size(group), group_rank(group)
        x = x.contiguous()
        s_l, b, d_in = x.shape
        gathered = torch.empty((tp * s_l, b, d_in), dtype=x.dtype, device=x.device)
        handle = dist.all_gather_into_tensor(gathered, x, group=group, async_op=True)
        d_out = weight.shape[0]
        y = torch.empty((tp * s_l, b, d_out), dtype=x.dtype, device=x.device)  # [s, b, out/tp]
        rows = s_l * b
        y2d = y.view(tp * rows, d_out)
        _matmul_into(y2d[rank * rows : (rank + 1) * rows], x.view(rows, d_in), weight, bias)
        handle.wait()
        g2d = gathered.view(tp * rows, d_in)
        for j in range(tp):
            if j != rank:
                _matmul_into(
                    y2d[j * rows : (j + 1) * rows], g2d[j * rows : (j + 1) * rows], weight, bias
                )
        ctx.save_for_backward(gathered, weight)
        ctx.group, ctx.fuse, ctx.has_bias = group, fuse, bias is not None
        return y

    @staticmethod
    def backward(ctx, g):
        gathered, weight = ctx.saved_tensors
        tp = group_size(ctx.group)
        g = g.contiguous()
        grad_full = g.matmul(weight)  # [s, b, in]
        grad_x = torch.empty(
            (grad_full.shape[0] // tp,) + grad_full.shape[1:], dtype=g.dtype, device=g.device
        )
        handle = dist.reduce_scatter_tensor(grad_x, grad_full, group=ctx.group, async_op=True)
        g2d = g.view(-1, g.shape[-1])
        grad_w = weight_grad(weight, g2d, gathered.view(-1, gathered.shape[-1]), ctx.fuse)
        grad_b = g2d.sum(0) if ctx.has_bias else None
        handle.wait()
        return grad_x, grad_w, grad_b, None, None


class _RowSequenceParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, fuse):
        tp = group_size(group)
        y = torch.nn.functional.linear(x, weight)  # partial sums [s, b, out]
        out = torch.empty((y.shape[0] // tp,) + y.shape[1:], dtype=y.dtype, device=y.device)
        dist.reduce_scatter_tensor(out, y.contiguous(), group=group)  # [s/tp, b, out]
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.fuse = group, fuse
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        tp, rank = group_size(ctx.group), group_rank(ctx.group)
        g = g.contiguous()  # [s/tp, b, out]
        s_l, b, d_out = g.shape
        g_full = torch.empty((tp * s_l, b, d_out), dtype=g.dtype, device=g.device)
        handle = dist.all_gather_into_tensor(g_full, g, group=ctx.group, async_op=True)
        d_in = weight.shape[1]
        grad_x = torch.empty((tp * s_l, b, d_in), dtype=g.dtype, device=g.device)
        rows = s_l * b
        gx2d = grad_x.view(tp * rows, d_in)
        torch.mm(g.view(rows, d_out), weight, out=gx2d[rank * rows : (rank + 1) * rows])
        handle.wait()
        gf2d = g_full.view(tp * rows, d_out)
        for j in range(tp):
            if j != rank:
                torch.mm(
                    gf2d[j * rows : (j + 1) * rows], weight, out=gx2d[j * rows : (j + 1) * rows]
                )
        grad_w = weight_grad(weight, gf2d, x.reshape(-1, d_in), ctx.fuse)
        return grad_x, grad_w, None, None


def column_sequence_parallel_linear(x, weight, bias, group, fuse: bool):
    """[s/tp, b, in] -> [s, b, out/tp]: all-gather overlapped with the local chunk's GEMM."""
    return _ColumnSequenceParallelLinear.apply(x, weight, bias, group, fuse)


def row_sequence_parallel_linear(x, weight, group, fuse: bool):
    """[s, b, in/tp] -> [s/tp, b, out] (reduce-scattered; no bias)."""
    return _RowSequenceParallelLinear.apply(x, weight, group, fuse)
