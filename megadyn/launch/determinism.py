"""--deterministic-mode (Megatron-LM's flag): the same command line on the same GPUs gives the
same losses bit for bit, run after run.

Without it, two kernels of an ordinary step add in an order that changes from run to run:
the attention backward accumulates dQ with atomics across key blocks (flash and memory-efficient
SDPA alike), and cuBLAS may split a GEMM's reduction over a workspace differently. The losses
then differ in their last bits (about 4e-5 after 8 steps of the gate's small model). The mode
turns on torch's deterministic algorithms with `warn_only=False`, which is what makes the SDPA
backward pick its deterministic kernel (with `warn_only=True` it keeps the atomic one and only
warns), and fixes cuBLAS's workspace (CUBLAS_WORKSPACE_CONFIG, unless set). It is switched on
before the process group starts, so that NCCL leaves out its NVLS algorithm, whose reductions
are not reproducible. An operation with no deterministic kernel then raises, naming itself.
It costs some speed (about 5% in the attention backward); it is for tests and for chasing
numerical differences, not for production runs.
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"


def enable() -> str:
    """Turn deterministic algorithms on in this process; return the line that says so."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=False)
    return (
        " deterministic mode: torch.use_deterministic_algorithms(True), "
        f"CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']} (--deterministic-mode)"
    )
