"""The attention of one ring block through torch's fused attention kernels, with the
log-sum-exp that merges blocks; the same interface as blocks.py's math path:

    out, lse = fused_block_forward(q, k, v, causal, scale)     # out [b, n, sq, d], lse [b, n, sq]
    dq, dk, dv = fused_block_backward(dout, q, k, v, out_all, lse_all, causal, scale)
    forward, backward = block_kernels(q, "flash")              # "flash", "cudnn", "math"; None: auto

Each function takes a trailing `visible` (blocks.py's document mask) and `dropout` (its
attention dropout scale) for the ring's uniform call; the fused kernels refuse them, and
`block_kernels(..., masked=True)` gives the math path.

q [b, n, sq, d] has n heads, k and v [b, g, sk, d] have g key/value heads (grouped queries are
expanded to n heads for the kernel, and their gradients summed back). `causal` masks key j for
query i when j > i, with queries and keys starting at the same position (the ring uses it on
square blocks only). The backward takes the final output and log-sum-exp of the query rows over
every key block (the flash-attention identity, as in blocks.py), so the kernel's gradients of
all blocks add up to those of the whole attention.

"flash" is torch's flash attention on CUDA (16-bit inputs) and its CPU flash kernels on CPU,
which the tests compare with the math path; "cudnn" is torch's cuDNN attention (CUDA only). The
output is in the input's dtype, the log-sum-exp in fp32; the caller merges blocks in fp32.
None picks, for CUDA 16-bit blocks, cuDNN on Hopper (as the model's attention does without
cp: on H100 the ring's flash blocks ran cp 2 at 0.70x tp 2 at 32k) and flash elsewhere, and the
math path otherwise. `--attention-backend`
chooses for the model (`kernel_for_backend`).
"""

from __future__ import annotations

import functools

import torch

from megadyn.core.context_parallel.blocks import (
    _expand,
    _reduce_heads,
    block_backward,
    block_forward,
)

_aten = torch.ops.aten
FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""Input dtypes of the CUDA flash kernels."""


def _rows(x: torch.Tensor) -> torch.Tensor:
    """The flash kernels (and cuDNN's log-sum-exp input) read contiguous tensors; slices of
    the ring's blocks may not be. cuDNN reads strided q, k, v, out and their gradients."""
    return x.contiguous()


def _unmasked(visible, dropout=None) -> None:
    if visible is not None or dropout is not None:
        raise ValueError(
            "the fused block kernels take no document mask or dropout (those blocks: math)"
        )


def fused_block_forward(
    q, k, v, causal: bool, scale: float, visible=None, dropout=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [b, n, sq, d] over k, v [b, g, sk, d] by the fused kernel: output
    [b, n, sq, d] (q's dtype) and log-sum-exp of the scaled scores [b, n, sq] (fp32)."""
    _unmasked(visible, dropout)
    heads = q.shape[1]
    q, k, v = _rows(q), _rows(_expand(k, heads)), _rows(_expand(v, heads))
    if q.device.type != "cpu":  # CUDA (and meta tensors, which check the call)
        res = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]
    return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def fused_block_backward(
    dout, q, k, v, out, lse, causal: bool, scale: float, visible=None, dropout=None
):
    """Gradients of q, k, v for one block by the fused kernel, given the final `out` and `lse`
    of q's rows over all key blocks and the gradient `dout` of `out`: dq [b, n, sq, d], dk and
    dv [b, g, sk, d], in the inputs' dtype."""
    _unmasked(visible, dropout)
    heads, groups = q.shape[1], k.shape[1]
    q, dout, out, lse = _rows(q), _rows(dout.to(q.dtype)), _rows(out.to(q.dtype)), _rows(lse)
    k, v = _rows(_expand(k, heads)), _rows(_expand(v, heads))
    if q.device.type != "cpu":  # CUDA (and meta tensors, which check the call)
        sq, sk = q.shape[2], k.shape[2]
        # no dropout: the kernel reads neither the random seed nor the offset
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, sq, sk, 0.0, causal, seed, offset, scale=scale
        )
    else:
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    return dq, _reduce_heads(dk, groups), _reduce_heads(dv, groups)


def cudnn_block_forward(q, k, v, causal: bool, scale: float, visible=None, dropout=None):
    """`fused_block_forward` through torch's cuDNN attention (CUDA)."""
    _unmasked(visible, dropout)
    heads = q.shape[1]
    # cuDNN reads strided operands: the ring's row and column slices go in without a copy
    k, v = _expand(k, heads), _expand(v, heads)
    res = _aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    return res[0], res[1].squeeze(-1)  # cuDNN's log-sum-exp is [b, n, sq, 1]


def cudnn_block_backward(
    dout, q, k, v, out, lse, causal: bool, scale: float, visible=None, dropout=None
):
    """`fused_block_backward` through torch's cuDNN attention (CUDA)."""
    _unmasked(visible, dropout)
    heads, groups = q.shape[1], k.shape[1]
    dout, out = dout.to(q.dtype), out.to(q.dtype)  # strided operands, as in the forward
    k, v = _expand(k, heads), _expand(v, heads)
    lse = _rows(lse.unsqueeze(-1))
    seed = offset = torch.empty((), dtype=torch.long, device=q.device)  # no dropout: unread
    dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, None, None,
        q.shape[2], k.shape[2], 0.0, causal, scale=scale,
    )  # fmt: skip
    return dq, _reduce_heads(dk, groups), _reduce_heads(dv, groups)


KERNELS = {
    "flash": (fused_block_forward, fused_block_backward),
    "cudnn": (cudnn_block_forward, cudnn_block_backward),
    "math": (block_forward, block_backward),
}
"""Block kernels by name: (forward, backward)."""

_BACKENDS = {"auto": None, "flash": "flash", "fused": "cudnn", "unfused": "math", "local": "math"}


@functools.cache
def is_hopper(device_index: int) -> bool:
    """The CUDA device is a Hopper GPU (compute capability 9.x)."""
    return torch.cuda.get_device_capability(device_index)[0] == 9


def kernel_for_backend(backend: str) -> str | None:
    """The block kernel of `--attention-backend` (fused = cuDNN; auto: `block_kernels`' pick)."""
    return _BACKENDS[backend]


def fused_kernels(q: torch.Tensor, kernel: str | None = None):
    """The fused (forward, backward) that `block_kernels` takes for unmasked blocks like `q`,
    or None where it takes the math path (documents.py runs document-masked blocks with it)."""
    pair = block_kernels(q, kernel)
    return None if pair is KERNELS["math"] else pair


def block_kernels(q: torch.Tensor, kernel: str | None = None, masked: bool = False):
    """(forward, backward) for blocks like `q`: `kernel` by name, or for None, on CUDA in
    16-bit, cuDNN on Hopper (head sizes up to 128) or flash (up to 256), and blocks.py's math
    path otherwise; the math path for
    `masked` blocks (document masks or attention dropout), which the fused kernels do not
    take."""
    if masked:
        return KERNELS["math"]
    if kernel is None:
        fused = q.is_cuda and q.dtype in FLASH_DTYPES
        if fused and q.shape[-1] <= 128 and is_hopper(q.device.index or 0):
            kernel = "cudnn"
        else:
            kernel = "flash" if fused and q.shape[-1] <= 256 else "math"
    if kernel == "cudnn" and not q.is_cuda:
        raise ValueError("the cuDNN block kernel needs CUDA (--attention-backend fused)")
    return KERNELS[kernel]
