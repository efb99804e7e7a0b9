"""Triton kernels of the fused vocab-parallel cross entropy (cross_entropy.py owns the math).

The logits [s, b, V_local] are viewed as rows [s*b, V_local]; one program handles one row and
walks its vocabulary in BLOCK-sized chunks, accumulating in fp32:

    row_statistics   one read of the logits: per row the local max m, the local
                     sum_v exp(l_v - m) (online: the running sum is rescaled whenever the
                     running max grows) and the raw target logit (0 where the target id
                     is another rank's), three fp32 [s, b] tensors
    grad_logits      one read of the logits, one write of the gradient:
                     (exp(l - M) / S - onehot(target)) * grad_loss, in the logits' dtype
                     (over the logits themselves when the caller allows it)

No fp32 [s, b, V_local] tensor exists at any point. The kernels have no autotuning, so a
restarted process finds their compiled code in Triton's on-disk cache and its first call costs
milliseconds. On CUDA tensors they are compiled for the GPU; under Triton's interpreter
(TRITON_INTERPRET=1 set before triton is imported) they run on CPU tensors, which is how the
CPU tests check them.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

MAX_BLOCK = 4096
"""Vocabulary entries a program handles per loop step (fewer when the vocabulary is smaller)."""


@triton.jit
def _row_statistics_kernel(
    logits_ptr, target_ptr, stats_ptr, vocab_start, vocab_size, BLOCK: tl.constexpr
):
    """stats [3, rows] fp32: local max, local sum of exp(l - max), raw target logit."""
    row = tl.program_id(0).to(tl.int64)
    row_logits = logits_ptr + row * vocab_size
    cols = tl.arange(0, BLOCK)
    running_max = float("-inf")
    running_sum = 0.0
    for start in range(0, vocab_size, BLOCK):
        in_vocab = start + cols < vocab_size
        x = tl.load(row_logits + start + cols, mask=in_vocab, other=float("-inf"))
        x = x.to(tl.float32)  # [BLOCK]
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        rescale = tl.exp(running_max - new_max)  # 0 on the first step (running_max = -inf)
        running_sum = running_sum * rescale + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    local_target = tl.load(target_ptr + row) - vocab_start
    inside = (local_target >= 0) & (local_target < vocab_size)
    target_logit = tl.load(row_logits + tl.where(inside, local_target, 0), mask=inside, other=0.0)
    rows = tl.num_programs(0)
    tl.store(stats_ptr + row, running_max)
    tl.store(stats_ptr + rows + row, running_sum)
    tl.store(stats_ptr + 2 * rows + row, target_logit.to(tl.float32))


@triton.jit
def _grad_logits_kernel(
    logits_ptr, grad_ptr, target_ptr, stats_ptr, vocab_start, vocab_size, BLOCK: tl.constexpr
):
    """stats [3, rows] fp32: global max M, global sum S, loss gradient g."""
    row = tl.program_id(0).to(tl.int64)
    row_logits = logits_ptr + row * vocab_size
    row_grad = grad_ptr + row * vocab_size
    cols = tl.arange(0, BLOCK)
    rows = tl.num_programs(0)
    logits_max = tl.load(stats_ptr + row)
    inv_sum = 1.0 / tl.load(stats_ptr + rows + row)
    grad_loss = tl.load(stats_ptr + 2 * rows + row)
    # another rank's target lies outside [0, vocab_size): it matches no column
    local_target = tl.load(target_ptr + row) - vocab_start
    for start in range(0, vocab_size, BLOCK):
        in_vocab = start + cols < vocab_size
        x = tl.load(row_logits + start + cols, mask=in_vocab, other=0.0).to(tl.float32)
        softmax = tl.exp(x - logits_max) * inv_sum  # [BLOCK]
        onehot = tl.where(start + cols == local_target, 1.0, 0.0)
        grad = (softmax - onehot) * grad_loss
        tl.store(row_grad + start + cols, grad.to(grad_ptr.dtype.element_ty), mask=in_vocab)


def check_device(logits: torch.Tensor) -> None:
    """Refuse tensors the kernels cannot run on: CUDA, or any device under the interpreter."""
    if not logits.is_cuda and not isinstance(_row_statistics_kernel, InterpretedFunction):
        raise ValueError(
            f"the fused cross entropy runs Triton kernels on CUDA tensors, got {logits.device} "
            "logits; use fused=False (--no-cross-entropy-loss-fusion)"
        )


def _launch(kernel, rows2d: torch.Tensor, *args, block: int | None) -> None:
    """One program per row of rows2d [rows, V]; the kernel takes (rows2d, *args, V)."""
    rows, vocab = rows2d.shape
    block = block or min(MAX_BLOCK, triton.next_power_of_2(vocab))
    device = torch.cuda.device(rows2d.device) if rows2d.is_cuda else contextlib.nullcontext()
    with device:
        kernel[(rows,)](rows2d, *args, vocab, BLOCK=block, num_warps=8 if block >= 2048 else 4)


def row_statistics(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local max, local sum of exp(l - max) and raw target logit, each fp32 shaped like target.

    logits [..., V_local] (any float dtype), target [...] global vocabulary ids.
    """
    check_device(logits)
    rows2d = logits.reshape(-1, logits.shape[-1]).contiguous()  # [s*b, V/tp]
    stats = torch.empty(3, rows2d.shape[0], dtype=torch.float32, device=logits.device)
    target_rows = target.reshape(-1).contiguous()  # [s*b]
    _launch(_row_statistics_kernel, rows2d, target_rows, stats, vocab_start, block=block)
    return tuple(t.view(target.shape) for t in stats)


def grad_logits(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    logits_max: torch.Tensor,
    sum_exp: torch.Tensor,
    grad_loss: torch.Tensor,
    block: int | None = None,
    overwrite: bool = False,
) -> torch.Tensor:
    """(exp(l - logits_max) / sum_exp - onehot(target)) * grad_loss, shaped and typed as logits.

    logits_max, sum_exp: the global (all-reduced) statistics, fp32 shaped like target.
    `overwrite`: written over the logits themselves (each element is read, then written, by
    the same program), no second [s*b, V/tp] tensor.
    """
    check_device(logits)
    rows2d = logits.reshape(-1, logits.shape[-1]).contiguous()  # [s*b, V/tp]
    grad = rows2d if overwrite else torch.empty_like(rows2d)  # [s*b, V/tp], the logits' dtype
    stats = torch.stack([t.reshape(-1).float() for t in (logits_max, sum_exp, grad_loss)])
    target_rows = target.reshape(-1).contiguous()  # [s*b]
    _launch(_grad_logits_kernel, rows2d, grad, target_rows, stats, vocab_start, block=block)
    return grad.view(logits.shape)
