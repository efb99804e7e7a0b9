"""AdamW on main params kept as remainders, in one pass (--use-precision-aware-optimizer).

    adamw_remainders_(weight, remainder, grad, exp_avg, exp_avg_sq,
                      lr=..., beta1=..., beta2=..., eps=..., weight_decay=..., step=t,
                      grad_scale=c)

The fp32 main value of each element is its bf16 model weight (the high 16 bits, rounded) joined
with an int16 remainder (the low 16 bits, signed): remainders.py, whose int32 form the kernel
computes. One update reads the weight,
the remainder, the fp32 gradient and both fp32 moments once and writes the weight, the
remainder and the moments: 28 bytes an element, where an fp32 main copy updated by torch's
fused AdamW and then cast into the model weight moves 34. The update is torch's AdamW, op for
op in fp32 (decoupled weight decay, then the moments, then the bias-corrected step), on the
gradient times `grad_scale` (the clip's coefficient; 1.0 leaves it as it is), so the clip
costs no pass of its own over the gradients:

    g  = g * grad_scale
    p  = p * (1 - lr * weight_decay)
    m  = m + (1 - beta1) * (g - m)
    v  = v * beta2 + (1 - beta2) * g * g
    p  = p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

On CUDA one Triton kernel; elsewhere the same steps in torch operations (`reference_`), which
Triton's interpreter reproduces bit for bit on CPU tensors (the tests). Square root and divisions
are IEEE-rounded in both (torch's CPU float sqrt is not: the reference takes it in double). On the GPU the compiler
may contract a multiply and an add into one rounding, so the two differ in the last bit of
some elements, as torch's fused and foreach AdamW do.
"""

from __future__ import annotations

import functools
import math

import torch

from megadyn.core.optimizer.remainders import join, split

BLOCK = 2048
"""Elements per program."""


def _factors(lr, beta1, beta2, weight_decay, step) -> tuple[float, float, float]:
    """(weight decay factor, step size, sqrt of beta2's bias correction), in double as torch's
    AdamW computes them on the host."""
    return 1.0 - lr * weight_decay, lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step)


@torch.no_grad()
def reference_(weight, remainder, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps,
               weight_decay, step, grad_scale=1.0) -> None:  # fmt: skip
    """The update in torch operations, fp32 op by op (the kernel's arithmetic)."""
    decay, step_size, bc2_sqrt = _factors(lr, beta1, beta2, weight_decay, step)
    grad = grad * grad_scale
    p = join(weight, remainder) * decay
    exp_avg.add_((grad - exp_avg) * (1.0 - beta1))
    exp_avg_sq.mul_(beta2).add_(grad * grad * (1.0 - beta2))
    denom = exp_avg_sq.double().sqrt().float() / bc2_sqrt + eps  # correctly rounded
    p = p - exp_avg * step_size / denom
    high, low = split(p)
    weight.copy_(high)
    remainder.copy_(low)


def adamw_remainders_(weight, remainder, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps,
                      weight_decay, step, grad_scale=1.0) -> None:  # fmt: skip
    """One AdamW step of flat contiguous tensors in place: `weight` bf16, `remainder` int16,
    `grad` (read, times `grad_scale`), `exp_avg`, `exp_avg_sq` fp32, all of one length;
    `step` counts from 1."""
    n = weight.numel()
    if not all(
        t.numel() == n and t.is_contiguous() for t in (remainder, grad, exp_avg, exp_avg_sq)
    ):
        raise ValueError("adamw_remainders_ takes flat contiguous tensors of one length")
    kwargs = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
                  grad_scale=grad_scale)  # fmt: skip
    if not weight.is_cuda:
        reference_(weight, remainder, grad, exp_avg, exp_avg_sq, **kwargs)
        return
    _launch(weight, remainder, grad, exp_avg, exp_avg_sq, **kwargs)


def _launch(weight, remainder, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay,
            step, grad_scale=1.0) -> None:  # fmt: skip
    """The Triton kernel over the tensors (CUDA; CPU tensors under TRITON_INTERPRET=1)."""
    import triton

    n = weight.numel()
    if n == 0:
        return
    decay, step_size, bc2_sqrt = _factors(lr, beta1, beta2, weight_decay, step)
    _kernel()[(triton.cdiv(n, BLOCK),)](
        weight.view(torch.int16), remainder, grad, exp_avg, exp_avg_sq, n, grad_scale,
        decay, 1.0 - beta1, beta2, 1.0 - beta2, step_size, bc2_sqrt, eps, BLOCK=BLOCK,
    )  # fmt: skip


@functools.cache
def _kernel():
    """The Triton kernel, compiled on first use (triton is imported only where it runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_remainders_kernel(
        w_ptr, r_ptr, g_ptr, m_ptr, v_ptr, n, grad_scale,
        decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        high = tl.load(w_ptr + offs, mask=inside).to(tl.int32)
        low = tl.load(r_ptr + offs, mask=inside).to(tl.int32)
        g = tl.load(g_ptr + offs, mask=inside) * grad_scale
        m = tl.load(m_ptr + offs, mask=inside)
        v = tl.load(v_ptr + offs, mask=inside)
        p = ((high << 16) + low).to(tl.float32, bitcast=True) * decay
        m = m + (g - m) * one_minus_beta1
        v = v * beta2 + g * g * one_minus_beta2
        denom = tl.math.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - tl.math.div_rn(m * step_size, denom)
        bits = p.to(tl.int32, bitcast=True)
        high = (bits + 0x8000) >> 16
        low = bits - (high << 16)
        tl.store(w_ptr + offs, high.to(tl.int16), mask=inside)
        tl.store(r_ptr + offs, low.to(tl.int16), mask=inside)
        tl.store(m_ptr + offs, m, mask=inside)
        tl.store(v_ptr + offs, v, mask=inside)

    return adamw_remainders_kernel
