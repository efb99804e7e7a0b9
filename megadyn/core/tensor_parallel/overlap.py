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

Two implementations of the same schedule:
    "collectives"  NCCL all-gather / reduce-scatter launched asynchronously beside the GEMM of
                   the local chunk (any backend, CPU included)
    "symm_mem"     torch's symmetric-memory fused ops (`torch.ops.symm_mem.fused_all_gather_
                   matmul`, `fused_matmul_reduce_scatter`): chunks move between GPUs by copy
                   engines over NVLink while the GEMMs of the chunks already present run, and
                   the row-parallel forward's reduce-scatter is pipelined too (CUDA, nccl)
"auto" takes "symm_mem" where those ops exist and the tensors are on a GPU of an nccl group.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from megadyn.core.tensor_parallel.mappings import group_rank, group_size
from megadyn.core.tensor_parallel.wgrad import weight_grad

OVERLAP_IMPLS = ("auto", "collectives", "symm_mem")


def _symm_ops():
    return getattr(torch.ops, "symm_mem", None)


@functools.cache
def _enable_symm_mem(group_name: str) -> None:
    from torch.distributed import _symmetric_memory

    _symmetric_memory.enable_symm_mem_for_group(group_name)


def resolve_impl(impl: str, group, x: torch.Tensor) -> str:
    """The implementation that runs for `impl` with this group and input."""
    if impl not in OVERLAP_IMPLS:
        raise ValueError(f"tp comm overlap implementation must be one of {OVERLAP_IMPLS}")
    usable = (
        x.is_cuda
        and dist.get_backend(group) == "nccl"
        and hasattr(_symm_ops(), "fused_all_gather_matmul")
    )
    if impl == "symm_mem" and not usable:
        raise RuntimeError("symmetric-memory tp overlap needs CUDA tensors and an nccl group")
    chosen = "symm_mem" if impl == "symm_mem" or (impl == "auto" and usable) else "collectives"
    if chosen == "symm_mem":
        _enable_symm_mem(group.group_name)
    return chosen


def _matmul_into(out2d, x2d, weight, bias):
    if bias is None:
        torch.mm(x2d, weight.t(), out=out2d)
    else:
        torch.addmm(bias, x2d, weight.t(), out=out2d)


class _ColumnSequenceParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, fuse, impl):
        ctx.group, ctx.fuse, ctx.has_bias, ctx.impl = group, fuse, bias is not None, impl
        x = x.contiguous()
        if impl == "symm_mem":
            gathered, (y,) = _symm_ops().fused_all_gather_matmul(
                x, [weight.t()], 0, group.group_name
            )
            ctx.save_for_backward(gathered, weight)
            return y if bias is None else y.add_(bias)
        tp, rank = group_size(group), group_rank(group)
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
        return y

    @staticmethod
    def backward(ctx, g):
        gathered, weight = ctx.saved_tensors
        tp = group_size(ctx.group)
        g = g.contiguous()
        g2d = g.view(-1, g.shape[-1])
        if ctx.impl == "symm_mem":
            grad_x = _symm_ops().fused_matmul_reduce_scatter(
                g, weight, "sum", 0, ctx.group.group_name
            )
            grad_w = weight_grad(weight, g2d, gathered.view(-1, gathered.shape[-1]), ctx.fuse)
            grad_b = g2d.sum(0) if ctx.has_bias else None
            return grad_x, grad_w, grad_b, None, None, None
        grad_full = g.matmul(weight)  # [s, b, in]
        grad_x = torch.empty(
            (grad_full.shape[0] // tp,) + grad_full.shape[1:], dtype=g.dtype, device=g.device
        )
        handle = dist.reduce_scatter_tensor(grad_x, grad_full, group=ctx.group, async_op=True)
        grad_w = weight_grad(weight, g2d, gathered.view(-1, gathered.shape[-1]), ctx.fuse)
        grad_b = g2d.sum(0) if ctx.has_bias else None
        handle.wait()
        return grad_x, grad_w, grad_b, None, None, None


class _RowSequenceParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, fuse, impl):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.fuse, ctx.impl = group, fuse, impl
        if impl == "symm_mem":  # chunk GEMMs pipelined with the reduce-scatter
            return _symm_ops().fused_matmul_reduce_scatter(
                x.contiguous(), weight.t(), "sum", 0, group.group_name
            )
        tp = group_size(group)
        y = torch.nn.functional.linear(x, weight)  # partial sums [s, b, out]
        out = torch.empty((y.shape[0] // tp,) + y.shape[1:], dtype=y.dtype, device=y.device)
        dist.reduce_scatter_tensor(out, y.contiguous(), group=group)  # [s/tp, b, out]
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        tp, rank = group_size(ctx.group), group_rank(ctx.group)
        g = g.contiguous()  # [s/tp, b, out]
        if ctx.impl == "symm_mem":
            g_full, (grad_x,) = _symm_ops().fused_all_gather_matmul(
                g, [weight], 0, ctx.group.group_name
            )
            gf2d = g_full.view(-1, g_full.shape[-1])
            grad_w = weight_grad(weight, gf2d, x.reshape(-1, x.shape[-1]), ctx.fuse)
            return grad_x, grad_w, None, None, None
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
        return grad_x, grad_w, None, None, None


def column_sequence_parallel_linear(x, weight, bias, group, fuse: bool, impl: str = "auto"):
    """[s/tp, b, in] -> [s, b, out/tp]: all-gather overlapped with the local chunk's GEMM."""
    impl = resolve_impl(impl, group, x)
    return _ColumnSequenceParallelLinear.apply(x, weight, bias, group, fuse, impl)


def row_sequence_parallel_linear(x, weight, group, fuse: bool, impl: str = "auto"):
    """[s, b, in/tp] -> [s/tp, b, out] (reduce-scattered; no bias)."""
    impl = resolve_impl(impl, group, x)
    return _RowSequenceParallelLinear.apply(x, weight, group, fuse, impl)
