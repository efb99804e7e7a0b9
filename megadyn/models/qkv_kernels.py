"""Triton copy of a strided 5-d tensor whose last dimension is contiguous (qkv_split.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 32
"""Rows of d elements per program."""


@triton.jit
def _copy_rows_kernel(
    dst_ptr,
    src_ptr,
    n_rows,
    d1,
    d2,
    d3,
    d,
    ds0,
    ds1,
    ds2,
    ds3,
    ss0,
    ss1,
    ss2,
    ss3,
    BR: tl.constexpr,
    BD: tl.constexpr,
):
    """dst[i0, i1, i2, i3, :] = src[i0, i1, i2, i3, :] for BR of the n_rows rows (row =
    ((i0 * d1 + i1) * d2 + i2) * d3 + i3)."""
    row = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    i3 = row % d3
    i2 = (row // d3) % d2
    i1 = (row // (d3 * d2)) % d1
    i0 = row // (d3 * d2 * d1)
    dst_row = i0 * ds0 + i1 * ds1 + i2 * ds2 + i3 * ds3
    src_row = i0 * ss0 + i1 * ss1 + i2 * ss2 + i3 * ss3
    e = tl.arange(0, BD)
    inside = (row[:, None] < n_rows) & (e[None, :] < d)
    t = tl.load(src_ptr + src_row[:, None] + e[None, :], mask=inside)
    tl.store(dst_ptr + dst_row[:, None] + e[None, :], t, mask=inside)


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for 5-d tensors of one shape and dtype whose last dims are contiguous."""
    if src.stride(-1) != 1:
        src = src.contiguous()
    assert dst.stride(-1) == 1 and dst.shape == src.shape and dst.dtype == src.dtype
    d0, d1, d2, d3, d = dst.shape
    n_rows = d0 * d1 * d2 * d3
    if n_rows == 0:
        return
    _copy_rows_kernel[(triton.cdiv(n_rows, ROWS),)](
        dst,
        src,
        n_rows,
        d1,
        d2,
        d3,
        d,
        *dst.stride()[:4],
        *src.stride()[:4],
        BR=ROWS,
        BD=triton.next_power_of_2(d),
        num_warps=4,
    )
