"""Triton kernels of the fused residual add + norm (add_norm.py owns the autograd and the choice).

Rows are tokens [tokens, h]; a program holds whole rows of BLOCK >= h columns, in fp32:

    forward    s = x + a, rounded to x's dtype and written (the residual stream), then
               y = norm(s) * w (+ b) written, and per row the mean and 1/std (fp32)
    backward   one program walks `rows_per_program` rows: ds_total = ds + norm'(dy), written,
               and fp32 partial sums of dy * s_hat (weight) and dy (bias) per program,
               [programs, h] each, then summed over programs

The norm is LayerNorm, or RMSNorm with RMS (no mean, no bias). No autotuning. Under Triton's
interpreter (TRITON_INTERPRET=1 set before triton is imported) the kernels run on CPU tensors,
which is how the CPU tests check them.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

PROGRAMS_PER_SM = 3
"""Backward programs per multiprocessor, each summing its rows' weight and bias gradients into
one row of partials: at h = 2048 a program of 8 warps takes 70 registers a thread on sm_90, so
three fit at once; more programs would mean more partials to add up."""


@triton.jit
def _forward_kernel(
    x_ptr,
    a_ptr,
    w_ptr,
    b_ptr,
    s_ptr,
    y_ptr,
    stats_ptr,
    rows,
    cols,
    eps,
    RMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """stats [2, rows] fp32: mean (not written under RMS), 1/std."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    in_row = c < cols
    offsets = row * cols + c
    x = tl.load(x_ptr + offsets, mask=in_row, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + offsets, mask=in_row, other=0.0).to(tl.float32)
    s = (x + a).to(s_ptr.dtype.element_ty)  # the residual stream, rounded as torch's add
    tl.store(s_ptr + offsets, s, mask=in_row)
    s = s.to(tl.float32)
    if RMS:
        centered = s  # zeros past the row's end
    else:
        mean = tl.sum(s, axis=0) / cols
        tl.store(stats_ptr + row, mean)
        centered = tl.where(in_row, s - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / cols + eps)
    y = centered * rstd * tl.load(w_ptr + c, mask=in_row, other=0.0).to(tl.float32)
    if not RMS:
        y += tl.load(b_ptr + c, mask=in_row, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=in_row)
    tl.store(stats_ptr + rows + row, rstd)


@triton.jit
def _backward_kernel(
    grad_y_ptr,
    grad_s_ptr,
    s_ptr,
    w_ptr,
    stats_ptr,
    grad_x_ptr,
    partials_ptr,
    rows,
    cols,
    rows_per_program,
    RMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """partials [2, programs, cols] fp32: sums of dy * s_hat and of dy over this program's rows."""
    program = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    in_row = c < cols
    w = tl.load(w_ptr + c, mask=in_row, other=0.0).to(tl.float32)
    grad_w = tl.zeros([BLOCK], dtype=tl.float32)
    grad_b = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(rows_per_program):
        row = program * rows_per_program + i
        mask = in_row & (row < rows)  # a row past the end reads zeros and adds nothing
        offsets = row * cols + c
        s = tl.load(s_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(grad_y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        ds = tl.load(grad_s_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(stats_ptr + rows + row, mask=row < rows, other=0.0)
        if RMS:
            s_hat = s * rstd  # zeros where masked
        else:
            mean = tl.load(stats_ptr + row, mask=row < rows, other=0.0)
            s_hat = tl.where(mask, (s - mean) * rstd, 0.0)
        w_dy = w * dy
        grad = w_dy - s_hat * (tl.sum(s_hat * w_dy, axis=0) / cols)
        if not RMS:
            grad -= tl.sum(w_dy, axis=0) / cols
        tl.store(
            grad_x_ptr + offsets, (grad * rstd + ds).to(grad_x_ptr.dtype.element_ty), mask=mask
        )
        grad_w += dy * s_hat
        grad_b += dy
    programs = tl.num_programs(0)
    tl.store(partials_ptr + program * cols + c, grad_w, mask=in_row)
    tl.store(partials_ptr + (programs + program) * cols + c, grad_b, mask=in_row)


def check_device(x: torch.Tensor) -> None:
    """Refuse tensors the kernels cannot run on: CUDA, or any device under the interpreter."""
    if not x.is_cuda and not isinstance(_forward_kernel, InterpretedFunction):
        raise ValueError(
            f"the fused residual add + norm runs Triton kernels on CUDA tensors, got {x.device}; "
            "use --no-residual-norm-fusion"
        )


def _launch_options(t: torch.Tensor, cols: int):
    block = triton.next_power_of_2(cols)
    num_warps = min(16, max(4, block // 256))  # 2048 columns: 8 warps, 8 per thread (128 bits)
    device = torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
    return block, num_warps, device


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, each over several rows
    return torch.cuda.get_device_properties(device).multi_processor_count


def forward(x2d, a2d, weight, bias, eps: float, rms: bool):
    """(s = x + a, norm(s) * w (+ b), stats [2, rows] fp32) from contiguous x, a [rows, h]."""
    check_device(x2d)
    rows, cols = x2d.shape
    s, y = torch.empty_like(x2d), torch.empty_like(x2d)
    stats = torch.empty(2, rows, dtype=torch.float32, device=x2d.device)
    block, num_warps, device = _launch_options(x2d, cols)
    bias = weight if bias is None else bias  # unread under RMS
    with device:
        _forward_kernel[(rows,)](
            x2d, a2d, weight, bias, s, y, stats, rows, cols, eps,
            RMS=rms, BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
    return s, y, stats


def backward(grad_y, grad_s, s, weight, stats, rms: bool):
    """(d loss / d s in s's dtype, weight gradient, bias gradient (None under RMS)) from the
    contiguous output gradients grad_y, grad_s and saved s [rows, h], stats [2, rows]."""
    check_device(s)
    rows, cols = s.shape
    programs = min(rows, PROGRAMS_PER_SM * _multiprocessors(s.device))
    per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, per_program)
    grad_x = torch.empty_like(s)
    partials = torch.empty(2, programs, cols, dtype=torch.float32, device=s.device)
    block, num_warps, device = _launch_options(s, cols)
    with device:
        _backward_kernel[(programs,)](
            grad_y, grad_s, s, weight, stats, grad_x, partials, rows, cols, per_program,
            RMS=rms, BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
    grad_w, grad_b = partials.sum(1).to(weight.dtype)  # [2, h] -> two [h]
    return grad_x, grad_w, None if rms else grad_b
