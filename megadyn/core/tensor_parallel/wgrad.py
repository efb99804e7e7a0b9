"""Weight gradients accumulated straight into the fp32 DDP buffer (gradient accumulation fusion).

When a layer's own weight has a DDP `main_grad` of a wider dtype (bf16 weights, fp32 gradient
buffer), its weight-gradient GEMM adds into `main_grad` in fp32 (cuBLAS with beta = 1 and an
fp32 output) instead of writing a bf16 gradient that the DDP hook then reads and adds. The
layer marks `param.grad_added_to_main_grad` and hands autograd an unread placeholder, so the
DDP hook still fires (and skips its add). Used by layers.py.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _fused_wgrad_works(device: torch.device) -> bool:
    """Check once per device, on a small problem, that cuBLAS accumulates bf16 x bf16 into fp32
    in place (a capability probe of this machine, cached; no training state)."""
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(64, 96, device=device, generator=gen).to(torch.bfloat16)
        b = torch.randn(96, 80, device=device, generator=gen).to(torch.bfloat16)
        c = torch.randn(64, 80, device=device, generator=gen)
        ref = c + a.float() @ b.float()
        torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
        return bool(torch.allclose(c, ref, rtol=1e-4, atol=1e-3))
    except (RuntimeError, TypeError):
        return False


def fuse_wgrad(weight, fuse: bool) -> bool:
    """Whether `weight`'s gradient may go straight into its (wider) `main_grad`."""
    main_grad = getattr(weight, "main_grad", None) if fuse else None
    return (
        main_grad is not None
        and main_grad.dtype != weight.dtype
        and weight.requires_grad
        and torch.is_grad_enabled()
    )


def weight_grad(weight, g2d: torch.Tensor, x2d: torch.Tensor, fuse: bool) -> torch.Tensor:
    """d loss / d W = g^T x ([out, in] from g [tokens, out], x [tokens, in]); with `fuse`,
    added into `weight.main_grad` and an unread placeholder returned."""
    if not fuse:
        return g2d.t().mm(x2d)
    main_grad = weight.main_grad  # [out, in] fp32
    if not _fused_wgrad_works(g2d.device):
        return add_to_main_grad(weight, g2d.t().mm(x2d))
    torch.addmm(main_grad, g2d.t(), x2d, out_dtype=main_grad.dtype, out=main_grad)
    return _added(weight)


def add_to_main_grad(weight, grad_w: torch.Tensor) -> torch.Tensor:
    """Add a computed weight gradient (fp8 GEMMs write one in the weight's dtype) into `weight.main_grad`;
    the placeholder to hand autograd."""
    weight.main_grad.add_(grad_w)
    return _added(weight)


def _added(weight) -> torch.Tensor:
    weight.grad_added_to_main_grad = True
    return torch.empty_like(weight)  # autograd needs a gradient for the DDP hook to fire
