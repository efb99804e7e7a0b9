"""SwiGLU's backward in one pass: fc1's gradient from its output and SwiGLU's gradient.

    dy = swiglu_backward(y, dh)    # y [..., 2f] = [gate, up]; dh [..., f]; dy like y

With s = sigmoid(gate), computed in fp32 and rounded once:
    d gate = dh * up * s * (1 + gate * (1 - s))
    d up   = dh * gate * s

On CUDA one Triton kernel reads gate, up and dh once and writes each half of dy where it
belongs (4.2 bytes moved per output element of the forward instead of the compiled backward's
masked `cat`, which ran at half the bandwidth: 323 us for a [8192, 2 x 8192] bf16 fc1 output on
an H200). Elsewhere the same formula in torch operations.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 1024
"""Elements of one half-row per program."""


def swiglu_backward(y: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """d loss / d y for h = silu(gate) * up, (gate, up) = y.chunk(2, -1), given dh."""
    if not y.is_cuda:
        gate, up = y.float().chunk(2, dim=-1)
        s, d = torch.sigmoid(gate), dh.float()
        return torch.cat([d * up * s * (1 + gate * (1 - s)), d * gate * s], dim=-1).to(y.dtype)
    return _triton_backward(y.contiguous(), dh.contiguous())


def _triton_backward(y: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    import triton

    f = dh.shape[-1]
    rows = dh.numel() // f
    dy = torch.empty_like(y)
    if rows:
        _kernel()[(rows, triton.cdiv(f, BLOCK))](y, dh, dy, f, BLOCK=BLOCK, num_warps=4)
    return dy


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu_backward_kernel(y_ptr, dh_ptr, dy_ptr, f, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < f
        gate_at = y_ptr + row * 2 * f + cols
        gate = tl.load(gate_at, mask=inside).to(tl.float32)
        up = tl.load(gate_at + f, mask=inside).to(tl.float32)
        d = tl.load(dh_ptr + row * f + cols, mask=inside).to(tl.float32)
        s = tl.sigmoid(gate)
        d_gate = d * up * s * (1.0 + gate * (1.0 - s))
        d_up = d * gate * s
        out = dy_ptr + row * 2 * f + cols
        tl.store(out, d_gate.to(dy_ptr.dtype.element_ty), mask=inside)
        tl.store(out + f, d_up.to(dy_ptr.dtype.element_ty), mask=inside)

    return swiglu_backward_kernel
