"""Weight gradients accumulated straight into the fp32 DDP buffer (gradient accumulation fusion).

When a layer's own weight has a DDP `main_grad` of a wider dtype (bf16 weights, fp32 gradient
buffer), its weight-gradient GEMM adds into `main_grad` in fp32 (cuBLAS with beta = 1 and an
fp32 output) instead of writing a bf16 gradient that the DDP hook then reads and adds. The
layer marks `param.grad_added_to_main_grad` and hands autograd an unread placeholder, so the
DDP hook still fires (and skips its add). A fused layer's bias gradient (the column sums of
the output gradient) goes into the bias's `main_grad` the same way, summed in fp32 on CUDA,
and an untied embedding table's gradient row by row (`embedding_grad`). Used by layers.py.

Layers and the DDP hook reach a parameter's `main_grad` through `main_grad_of(param)`: under
--data-parallel-sharding-strategy optim_grads a parameter has no persistent `main_grad` but a
`grad_staging` bucket, which materializes the micro batch's gradient on first use
(megadyn/core/distributed/sharded_grads.py); otherwise it is `param.main_grad` itself.
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


def main_grad_of(param) -> torch.Tensor:
    """The tensor `param`'s gradient is added into: `param.main_grad`, or under optim_grads the
    view of its bucket's staging for this micro batch (allocated, zeroed, on first use)."""
    staging = getattr(param, "grad_staging", None)
    return param.main_grad if staging is None else staging.main_grad(param)


def main_grad_dtype(param) -> torch.dtype | None:
    """The dtype of `param`'s `main_grad` without materializing it (None: it has none)."""
    staging = getattr(param, "grad_staging", None)
    if staging is not None:
        return staging.grad_shard.dtype
    main_grad = getattr(param, "main_grad", None)
    return None if main_grad is None else main_grad.dtype


def fuse_wgrad(weight, fuse: bool) -> bool:
    """Whether `weight`'s gradient may go straight into its (wider) `main_grad`."""
    dtype = main_grad_dtype(weight) if fuse else None
    return (
        dtype is not None
        and dtype != weight.dtype
        and weight.requires_grad
        and torch.is_grad_enabled()
    )


def weight_grad(weight, g2d: torch.Tensor, x2d: torch.Tensor, fuse: bool) -> torch.Tensor:
    """d loss / d W = g^T x ([out, in] from g [tokens, out], x [tokens, in]); with `fuse`,
    added into `weight.main_grad` and an unread placeholder returned."""
    if not fuse:
        return g2d.t().mm(x2d)
    if not _fused_wgrad_works(g2d.device):
        return add_to_main_grad(weight, g2d.t().mm(x2d))
    main_grad = main_grad_of(weight)  # [out, in] fp32
    torch.addmm(main_grad, g2d.t(), x2d, out_dtype=main_grad.dtype, out=main_grad)
    return _added(weight)


def bias_grad(bias, g2d: torch.Tensor, fuse: bool) -> torch.Tensor:
    """d loss / d b = the column sums of g [tokens, out]; with `fuse`, added into
    `bias.main_grad` and an unread placeholder returned: on CUDA by one GEMM, ones [1, tokens]
    x g, accumulated in fp32 into main_grad (one launch where torch's bf16 sum and the DDP
    hook's add are two, and a fifth faster on an H200); elsewhere by the sum and an add."""
    if not fuse:
        return g2d.sum(0)
    if not (g2d.is_cuda and _fused_wgrad_works(g2d.device)):
        return add_to_main_grad(bias, g2d.sum(0))
    main_grad = main_grad_of(bias).view(1, -1)
    ones = _ones(g2d.shape[0], g2d.dtype, g2d.device)
    torch.addmm(main_grad, ones, g2d, out_dtype=main_grad.dtype, out=main_grad)
    return _added(bias)


def embedding_grad(weight, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """d loss / d W of the lookup W[ids] (g [..., h], the output gradient), added into
    `weight.main_grad` row by row: the [tokens, h] rows widened and summed into their rows by
    one sorted (deterministic) accumulation, where a dense [rows, h] gradient in W's dtype
    would be written, then read and added by the DDP hook. An unread placeholder returned."""
    main_grad = main_grad_of(weight)
    rows = g.reshape(-1, g.shape[-1]).to(main_grad.dtype)
    main_grad.index_put_((ids.reshape(-1),), rows, accumulate=True)
    return _added(weight)


_ONES: dict[tuple, list[torch.Tensor]] = {}


def _ones(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [1, n] row of ones, kept per dtype and device (a constant, not training state). A longer
    row, when needed, is added beside the shorter ones, never in place of them: a captured CUDA
    graph may read a kept row, whose memory must stay its own. One made while a graph is
    captured holds its values only once the graph runs, so it is not kept."""
    kept = _ONES.setdefault((dtype, device), [])
    if not kept or kept[-1].shape[1] < n:
        ones = torch.ones(
            1, max(n, 2 * kept[-1].shape[1] if kept else n), dtype=dtype, device=device
        )
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return ones[:, :n]
        kept.append(ones)
    return kept[-1][:, :n]


def add_to_main_grad(weight, grad_w: torch.Tensor) -> torch.Tensor:
    """Add a computed weight gradient (fp8 GEMMs write one in the weight's dtype) into `weight.main_grad`;
    the placeholder to hand autograd."""
    accumulate(main_grad_of(weight), grad_w)
    return _added(weight)


TRITON_ADD_MIN = 1 << 20
"""Gradients of fewer elements (norms, biases) are added by torch: its launch costs the host
less, and the add is too short for the kernel's speed to matter."""


def accumulate(main_grad: torch.Tensor, grad: torch.Tensor) -> None:
    """main_grad += grad; on CUDA a large gradient in a narrower dtype goes into the fp32 buffer
    by one vectorized pass (grad_kernels.py), the same bits as `add_`."""
    if (
        grad.is_cuda
        and main_grad.dtype == torch.float32
        and grad.dtype != main_grad.dtype
        and grad.numel() >= TRITON_ADD_MIN
        and grad.is_contiguous()
        and main_grad.is_contiguous()
    ):
        from megadyn.core.tensor_parallel.grad_kernels import add_into

        add_into(main_grad, grad)
    else:
        main_grad.add_(grad)


def _added(weight) -> torch.Tensor:
    weight.grad_added_to_main_grad = True
    return torch.empty_like(weight)  # autograd needs a gradient for the DDP hook to fire
