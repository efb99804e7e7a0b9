"""Sequence-parallel column-parallel linear whose input-gradient reduce-scatter overlaps the
weight-gradient GEMM (--tp-comm-overlap).

Opt-in (`GPTConfig.tp_comm_overlap`); the plain path is `gather_from_sequence` + `F.linear`,
whose reduce-scatter runs after both backward GEMMs. Input [s/tp, b, in] per rank, output
[s, b, out/tp]:
    forward   all-gather the input along the sequence, then one GEMM
    backward  the input gradient [s, b, in] is reduce-scattered while the weight-gradient
              GEMM runs (accumulated into `main_grad` as layers.py does, wgrad.py)

GEMMs are not split into sequence chunks to run beside the collectives: on H200 the chunked
variants (all-gather beside the own chunk's GEMM, ring exchanges) were slower per step than
the unsplit GEMMs (BENCHMARKS.md). The row-parallel layer has nothing to overlap without
splitting its GEMMs and takes the plain path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megadyn.core.tensor_parallel.mappings import gather_sequence, group_size
from megadyn.core.tensor_parallel.wgrad import weight_grad


class _ColumnSequenceParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, fuse):
        gathered = gather_sequence(x, group)  # [s, b, in]
        ctx.save_for_backward(gathered, weight)
        ctx.group, ctx.fuse, ctx.has_bias = group, fuse, bias is not None
        return torch.nn.functional.linear(gathered, weight, bias)  # [s, b, out/tp]

    @staticmethod
    def backward(ctx, g):
        gathered, weight = ctx.saved_tensors
        tp = group_size(ctx.group)
        g = g.contiguous()
        grad_full = g.matmul(weight)  # [s, b, in], partial sums over tp
        grad_x = torch.empty(
            (grad_full.shape[0] // tp,) + grad_full.shape[1:], dtype=g.dtype, device=g.device
        )
        handle = dist.reduce_scatter_tensor(grad_x, grad_full, group=ctx.group, async_op=True)
        g2d = g.view(-1, g.shape[-1])
        grad_w = weight_grad(weight, g2d, gathered.view(-1, gathered.shape[-1]), ctx.fuse)
        grad_b = g2d.sum(0) if ctx.has_bias else None
        handle.wait()
        return grad_x, grad_w, grad_b, None, None


def column_sequence_parallel_linear(x, weight, bias, group, fuse: bool):
    """[s/tp, b, in] -> [s, b, out/tp]; the input gradient's reduce-scatter overlaps the
    weight-gradient GEMM."""
    return _ColumnSequenceParallelLinear.apply(x, weight, bias, group, fuse)
