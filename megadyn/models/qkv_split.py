"""The split of the fused QKV output into queries, keys and values, with a one-pass backward.

    q, k, v = split_qkv(qkv, q_per_group)   # qkv [s, b, g, q + 2, d] -> views of it

The forward is `torch.split` along dim 3 (views, no copy); its backward writes the three
gradients into one new tensor of qkv's shape, each into its slice (`cat`). The gradients come
from the attention kernel in its own layout ([b, n, s, d] permuted to [s, b, n, d]), so every
slice is a strided copy, which torch's `cat` runs element by element (about a third of the
memory bandwidth on an H100/H200). While a CUDA graph is captured, the split is a Function
whose backward copies each slice by a Triton kernel that reads and writes rows of d contiguous
elements (10 us instead of 21 for a [2048, 2, 16, 128] slice on an H200). An eager step keeps
torch's split: there the host launches every kernel, and three Triton launches cost it more
than the copies save. The values are the same either way (a copy), so every path gives the
gradient of `torch.split` bit for bit.
"""

from __future__ import annotations

import torch


class _SplitQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: torch.Tensor, q_per_group: int):
        ctx.sizes = [q_per_group, 1, 1]
        return torch.split(qkv, ctx.sizes, dim=3)

    @staticmethod
    def backward(ctx, *grads):
        from megadyn.models.qkv_kernels import copy_rows

        ref = next(g for g in grads if g is not None)
        s, b, groups, _, d = ref.shape
        out = torch.empty(s, b, groups, sum(ctx.sizes), d, dtype=ref.dtype, device=ref.device)
        for part, grad in zip(torch.split(out, ctx.sizes, dim=3), grads):
            if grad is None:
                part.zero_()
            else:
                copy_rows(part, grad)
        return out, None


def split_qkv(qkv: torch.Tensor, q_per_group: int):
    """(q [s, b, g, q_per_group, d], k [s, b, g, 1, d], v [s, b, g, 1, d]): views of qkv."""
    if qkv.is_cuda and qkv.shape[-1] <= 256 and torch.cuda.is_current_stream_capturing():
        return _SplitQKV.apply(qkv, q_per_group)
    return torch.split(qkv, [q_per_group, 1, 1], dim=3)
