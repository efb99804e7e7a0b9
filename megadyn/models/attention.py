"""Which kernel runs `scaled_dot_product_attention`: one context per attention call.

    with attention_kernels("auto", q):   # cuDNN first on Hopper, then flash, efficient, math
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)

torch picks the first enabled kernel of its priority order that supports the inputs; 'auto' puts
cuDNN's fused attention first on compute capability 9.x (H100/H200), where it runs the
Hopper-specific kernels that torch's flash kernel lacks. A named kernel is the only one enabled,
so inputs it cannot take fail loudly instead of silently running another one.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from megadyn.core.context_parallel.kernels import is_hopper

_NAMED = {  # Megatron's --attention-backend names
    "flash": SDPBackend.FLASH_ATTENTION,
    "fused": SDPBackend.CUDNN_ATTENTION,
    "unfused": SDPBackend.MATH,
    "local": SDPBackend.MATH,
}
_HOPPER_ORDER = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


def attention_kernels(backend: str, q: torch.Tensor):
    """The context that selects the attention kernel for `q`'s device."""
    if backend in _NAMED:
        return sdpa_kernel(_NAMED[backend])
    if q.is_cuda and is_hopper(q.device.index or 0):
        return sdpa_kernel(_HOPPER_ORDER, set_priority=True)
    return contextlib.nullcontext()
