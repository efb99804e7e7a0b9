"""The attention of one ring block through torch's fused flash-attention kernels, with the
log-sum-exp that merges blocks; the same interface as blocks.py's math path:

    out, lse = fused_block_forward(q, k, v, causal, scale)     # out [b, n, sq, d], lse [b, n, sq]
    dq, dk, dv = fused_block_backward(dout, q, k, v, out_all, lse_all, causal, scale)
    forward, backward = block_kernels(q)                         # fused where it runs, else math

q [b, n, sq, d] has n heads, k and v [b, g, sk, d] have g key/value heads (grouped queries are
expanded to n heads for the kernel, and their gradients summed back). `causal` masks key j for
query i when j > i, with queries and keys starting at the same position (the ring uses it on
square blocks only). The backward takes the final output and log-sum-exp of the query rows over
every key block (the flash-attention identity, as in blocks.py), so the kernel's gradients of
all blocks add up to those of the whole attention.

On CUDA the kernels are torch's flash attention (16-bit inputs); on CPU torch's CPU flash
kernels, which the tests compare with the math path. The output is in the input's dtype, the
log-sum-exp in fp32; the caller merges blocks in fp32.
"""

from __future__ import annotations

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
    """The kernels read rows with unit stride; slices of the ring's blocks may not be."""
    return x.contiguous()


def fused_block_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [b, n, sq, d] over k, v [b, g, sk, d] by the fused kernel: output
    [b, n, sq, d] (q's dtype) and log-sum-exp of the scaled scores [b, n, sq] (fp32)."""
    heads = q.shape[1]
    q, k, v = _rows(q), _rows(_expand(k, heads)), _rows(_expand(v, heads))
    if q.is_cuda:
        res = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]
    return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def fused_block_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients of q, k, v for one block by the fused kernel, given the final `out` and `lse`
    of q's rows over all key blocks and the gradient `dout` of `out`: dq [b, n, sq, d], dk and
    dv [b, g, sk, d], in the inputs' dtype."""
    heads, groups = q.shape[1], k.shape[1]
    q, dout, out, lse = _rows(q), _rows(dout.to(q.dtype)), _rows(out.to(q.dtype)), _rows(lse)
    k, v = _rows(_expand(k, heads)), _rows(_expand(v, heads))
    if q.is_cuda:
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


def fused_kernels_run(q: torch.Tensor) -> bool:
    """Whether the fused kernels take blocks like `q`: CUDA in 16-bit (flash attention's head
    sizes up to 256); CPU runs the math path unless asked for the fused one."""
    return q.is_cuda and q.dtype in FLASH_DTYPES and q.shape[-1] <= 256


def block_kernels(q: torch.Tensor, fused: bool | None = None):
    """(forward, backward) for blocks like `q`: the fused kernels where they run (or where
    `fused` asks for them), else blocks.py's math path."""
    use_fused = fused_kernels_run(q) if fused is None else fused
    if use_fused:
        return fused_block_forward, fused_block_backward
    return block_forward, block_backward
