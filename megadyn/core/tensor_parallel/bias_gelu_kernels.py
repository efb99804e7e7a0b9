"""Triton kernels of the fused bias-GeLU (bias_gelu.py owns the autograd and the choice).

fc1's output y [tokens, ffn/tp] (bias left out of the GEMM) is cut into BLOCK_M x BLOCK_N
tiles over a 2D grid (row blocks, column blocks); each element is read once, widened to fp32,
and written once in y's dtype:

    forward    z = gelu(y + b)
    backward   dy = dz * gelu'(y + b), and per program the fp32 column sums of dy over its
               ROW_BLOCKS x BLOCK_M rows, written to partials [row groups, ffn/tp]; one small
               sum over the row groups gives the bias gradient

GeLU is exact (erf) or, with TANH, its tanh approximation (--openai-gelu). Rows of a tile are
contiguous columns of y, so loads and stores are 128-bit wide where ffn/tp is a multiple of 8.
No autotuning: a restarted process finds the compiled code in Triton's on-disk cache. Under
Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported) the kernels run on CPU
tensors, which is how the CPU tests check them.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

BLOCK_M = 16
"""Rows of a tile."""
BLOCK_N = 256
"""Columns of a tile."""
NUM_WARPS = 8
"""Warps of a program: 16 elements per thread of a 16 x 256 tile, two 128-bit bf16 accesses per
tensor (32 elements per thread take the backward from 80 to 164 registers on sm_90)."""
ROW_BLOCKS = 8
"""Tiles one backward program walks down its column block, summing the bias gradient."""


# The constants are written out: a compiled kernel reads no Python globals but constexprs, and
# the interpreter (the CPU tests) does not mix constexpr globals with tensors.
#   0.7071067811865476 = 1 / sqrt(2)   0.3989422804014327 = 1 / sqrt(2 pi)
#   0.7978845608028654 = sqrt(2 / pi)  0.044715: the tanh approximation's cubic coefficient


@triton.jit
def _tanh(u):
    return 2.0 * tl.sigmoid(2.0 * u) - 1.0


@triton.jit
def _gelu(x, TANH: tl.constexpr):
    """gelu(x) of fp32 x."""
    if TANH:
        t = _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))
    else:
        t = tl.erf(x * 0.7071067811865476)
    return 0.5 * x * (1.0 + t)


@triton.jit
def _gelu_grad(x, TANH: tl.constexpr):
    """d gelu(x) / dx of fp32 x."""
    if TANH:
        t = _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))
        du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
    pdf = 0.3989422804014327 * tl.exp(-0.5 * x * x)
    return 0.5 * (1.0 + tl.erf(x * 0.7071067811865476)) + x * pdf


@triton.jit
def _forward_kernel(
    y_ptr,
    bias_ptr,
    z_ptr,
    rows,
    cols,
    TANH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    in_cols = c < cols
    mask = (r < rows)[:, None] & in_cols[None, :]
    offsets = r[:, None] * cols + c[None, :]  # [BLOCK_M, BLOCK_N]
    b = tl.load(bias_ptr + c, mask=in_cols, other=0.0).to(tl.float32)
    x = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + b[None, :]
    tl.store(z_ptr + offsets, _gelu(x, TANH).to(z_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(
    grad_ptr,
    y_ptr,
    bias_ptr,
    dy_ptr,
    partials_ptr,
    rows,
    cols,
    TANH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
):
    """partials [row groups, cols] fp32: row group g = program_id(0) sums rows
    [g * ROW_BLOCKS * BLOCK_M, (g + 1) * ROW_BLOCKS * BLOCK_M)."""
    group = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    in_cols = c < cols
    b = tl.load(bias_ptr + c, mask=in_cols, other=0.0).to(tl.float32)
    # per element, summed over the row blocks; reduced over its rows once, at the end
    column_sums = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(ROW_BLOCKS):
        r = (group * ROW_BLOCKS + i) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        mask = (r < rows)[:, None] & in_cols[None, :]
        offsets = r[:, None] * cols + c[None, :]  # [BLOCK_M, BLOCK_N]
        x = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + b[None, :]
        g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = g * _gelu_grad(x, TANH)  # 0 on masked elements (g = 0 there)
        tl.store(dy_ptr + offsets, dy.to(dy_ptr.dtype.element_ty), mask=mask)
        column_sums += dy
    tl.store(partials_ptr + group * cols + c, tl.sum(column_sums, axis=0), mask=in_cols)


def check_device(y: torch.Tensor) -> None:
    """Refuse tensors the kernels cannot run on: CUDA, or any device under the interpreter."""
    if not y.is_cuda and not isinstance(_forward_kernel, InterpretedFunction):
        raise ValueError(
            f"the fused bias-GeLU runs Triton kernels on CUDA tensors, got {y.device}; "
            "use --no-bias-gelu-fusion"
        )


def _device(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def forward(y2d: torch.Tensor, bias: torch.Tensor, tanh: bool) -> torch.Tensor:
    """gelu(y + bias) [rows, cols] in y's dtype from contiguous y [rows, cols], bias [cols]."""
    check_device(y2d)
    rows, cols = y2d.shape
    z = torch.empty_like(y2d)
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(cols, BLOCK_N))
    with _device(y2d):
        _forward_kernel[grid](
            y2d,
            bias,
            z,
            rows,
            cols,
            TANH=tanh,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            num_warps=NUM_WARPS,
        )
    return z


def backward(
    grad2d: torch.Tensor, y2d: torch.Tensor, bias: torch.Tensor, tanh: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy [rows, cols] in y's dtype, db [cols] in the bias's dtype, summed in fp32) from the
    contiguous output gradient and input, both [rows, cols]."""
    check_device(y2d)
    rows, cols = y2d.shape
    dy = torch.empty_like(y2d)
    groups = triton.cdiv(rows, ROW_BLOCKS * BLOCK_M)
    partials = torch.empty(groups, cols, dtype=torch.float32, device=y2d.device)
    with _device(y2d):
        _backward_kernel[(groups, triton.cdiv(cols, BLOCK_N))](
            grad2d,
            y2d,
            bias,
            dy,
            partials,
            rows,
            cols,
            TANH=tanh,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            ROW_BLOCKS=ROW_BLOCKS,
            num_warps=NUM_WARPS,
        )
    return dy, partials.sum(0).to(bias.dtype)
