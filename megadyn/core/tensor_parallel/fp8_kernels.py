"""Triton kernels of tensorwise fp8 quantization on CUDA (fp8.py owns the math).

Two passes over the tensor instead of the half dozen of the same torch expression:

    amax     one read: max |t| of each block of BLOCK elements, folded into one fp32
             scalar by atomic max (abs values are non-negative, so the order is exact)
    cast     one read, one fp8 write (two with the transpose): the power-of-two scale from
             the amax (the exponent bits of fp8_max / amax), t * scale clamped to
             +-fp8_max and rounded to nearest even, by [64, 64] tiles, each also written
             transposed into q^T when asked (the backward GEMMs take the other layout);
             program 0 writes 1 / scale, the GEMM's dequantization factor

Between them the amax may be all-reduced over the tensor-parallel group. The cast also runs
alone, at the scale of a factor it wrote before (fp8.requantize: the backward's W^T, cast
again at the forward's scale). Every step runs on the device, with no host synchronization,
so the quantization can be captured in a CUDA graph. fp8.quantize gives the same bits with
torch operations (CPU, rowwise).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from megadyn.core.tensor_parallel.mappings import group_size

BLOCK = 8192
"""Elements per program of the amax kernel."""
TILE = 64
"""Rows and columns of a cast kernel's tile."""


@triton.jit
def _amax_kernel(t_ptr, amax_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    t = tl.load(t_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, tl.max(tl.abs(t), axis=0))


@triton.jit
def _cast_kernel(
    t_ptr,
    amax_ptr,
    q_ptr,
    qt_ptr,
    inv_ptr,
    rows,
    cols,
    fp8_max,
    amax_floor,
    TRANSPOSE: tl.constexpr,
    GIVEN_SCALE: tl.constexpr,
    WRITE_Q: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """One [BM, BN] tile of t [rows, cols] to q (and, with TRANSPOSE, q^T [cols, rows];
    without WRITE_Q q^T alone); with GIVEN_SCALE at the scale whose inverse `inv_ptr` holds
    (amax_ptr unread)."""
    if GIVEN_SCALE:
        scale = tl.math.div_rn(1.0, tl.load(inv_ptr))  # exact: a power of two
    else:
        amax = tl.maximum(tl.load(amax_ptr), amax_floor)
        quotient = tl.math.div_rn(fp8_max, amax)
        scale = (quotient.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    r = (pid_m.to(tl.int64) * BM + tl.arange(0, BM))[:, None]  # [BM, 1]
    c = (pid_n.to(tl.int64) * BN + tl.arange(0, BN))[None, :]  # [1, BN]
    inside = (r < rows) & (c < cols)
    t = tl.load(t_ptr + r * cols + c, mask=inside, other=0.0).to(tl.float32)
    q = tl.clamp(t * scale, -fp8_max, fp8_max).to(q_ptr.dtype.element_ty)
    if WRITE_Q:
        tl.store(q_ptr + r * cols + c, q, mask=inside)
    if TRANSPOSE:  # [BN, BM] tile of q^T
        tl.store(qt_ptr + tl.trans(c) * rows + tl.trans(r), tl.trans(q), mask=tl.trans(inside))
    if not GIVEN_SCALE:
        if (pid_m == 0) & (pid_n == 0):
            tl.store(inv_ptr, 1.0 / scale)  # exact: scale is a power of two


def quantize_tensorwise(
    t: torch.Tensor,
    dtype: torch.dtype,
    fp8_max: float,
    amax_floor: float,
    group=None,
    transpose: bool = False,
    inv_scale: torch.Tensor | None = None,
    write_q: bool = True,
):
    """(q, inv_scale, q^T or None) of fp8.quantize(t, dtype, None, group) for a CUDA tensor
    t [rows, cols]; q^T [cols, rows] is written by the same pass. With `inv_scale` (fp8.
    requantize) the cast pass alone, at that scale: no amax, no all-reduce. `write_q` False
    (with `transpose` and `inv_scale`): q^T alone is written, q is None."""
    if not write_q and not (transpose and inv_scale is not None):
        raise ValueError("write_q=False needs transpose=True and a given inv_scale")
    t = t.contiguous()
    given = inv_scale is not None
    if given:
        amax = inv = inv_scale
    else:
        n = t.numel()
        amax = torch.zeros((), dtype=torch.float32, device=t.device)
        _amax_kernel[(triton.cdiv(n, BLOCK),)](t, amax, n, BLOCK=BLOCK)
        if group_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        inv = torch.empty((), dtype=torch.float32, device=t.device)
    rows, cols = t.shape
    q = torch.empty(t.shape, dtype=dtype, device=t.device) if write_q else None
    qt = torch.empty((cols, rows), dtype=dtype, device=t.device) if transpose else None
    grid = (triton.cdiv(rows, TILE), triton.cdiv(cols, TILE))
    _cast_kernel[grid](  # an unwritten output's pointer is the other one
        t, amax, q if write_q else qt, qt if transpose else q, inv, rows, cols, fp8_max,
        amax_floor, TRANSPOSE=transpose, GIVEN_SCALE=given, WRITE_Q=write_q, BM=TILE, BN=TILE,
    )  # fmt: skip
    return q, inv, qt
