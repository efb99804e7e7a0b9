"""Import of a Triton kernel module of this package, with an error that names the switch.

    kernels = triton_kernels("bias_gelu_kernels", "the fused bias-GeLU", "--no-bias-gelu-fusion")

Triton comes with torch's CUDA builds; the kernel modules import it at their top, so they are
imported only when a fused path runs.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def triton_kernels(module: str, what: str, switch: str) -> ModuleType:
    try:
        return importlib.import_module(f"megadyn.core.tensor_parallel.{module}")
    except ImportError as e:
        raise ImportError(f"{what} needs Triton; install it or use {switch}") from e
