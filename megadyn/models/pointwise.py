"""The transformer block's pointwise work as small functions, compiled under --pointwise-fusion.

    fusions = Fusions.from_config(cfg)              # which regions run compiled
    h = fusions(fusions.norm, norm, x)(x, weight, bias, eps)

Each function is written once, in torch operations, and is the model's plain path op for op.
Under --pointwise-fusion it runs through `torch.compile(fn, dynamic=False, fullgraph=True)`
for CUDA tensors: inductor fuses each region into a Triton kernel or two each way (the
backward comes from AOT autograd). Elsewhere (the CPU, or the flag off) it runs as written.
The regions:

    norm         RMSNorm or LayerNorm (input norm and final norm)
    add_norm     residual + dropout(y), and the pre-MLP norm of that sum, in one pass (where
                 linear_fc1 keeps its input: under sequence parallelism; else the sum and
                 the norm run apart, so the backward can replay the norm alone)
    dropout_add  residual + dropout(y) (the MLP's residual, hidden dropout > 0)
    swiglu       silu(gate) * up from fc1's output [s, b, 2 * ffn/tp], gate and up halves
    rope_qk      rotary embeddings applied to queries and keys together

Compiled, they also keep less for the backward (what inductor's partitioner saves): SwiGLU
keeps only fc1's output and recomputes silu (eager also keeps silu(gate): 3/2 of it); a norm
keeps its 16-bit input and one fp32 statistic per token (eager on the CPU keeps fp32 copies
of the input), add_norm the sum. The linear layers that read the regions' outputs keep no copy
of them either (fc2: SwiGLU's output; linear_qkv and linear_fc1: the norms' outputs): the
backward computes them again from what the regions keep, replaying the regions' forward
graphs (`recomputed_in_backward`, megadyn/core/recomputed.py; under FP8 neither the 16-bit
input nor the fp8 x^T of a tensorwise layer is kept: the backward casts x^T again at the
forward's scale, a scalar, the same bits). The numbers differ from eager by 16-bit rounding only: inductor computes a
region in fp32 and rounds once at its outputs. With hidden dropout the compiled masks come
from inductor's own random numbers (same statistics, other bits), drawn from the generator
that is current (the tensor-parallel tracker's under sequence parallelism), so recomputation,
which restores the generators, draws the same masks again.

The functions see local shards only (tensor and sequence parallelism change their shapes, not
their code). Each is compiled lazily, once per function; a new shape (another micro batch
size, a layout change, evaluation without gradients) compiles once more. CUDA graphs capture
after eager warm-up steps of the same shapes, so nothing compiles during a capture.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def norm(x: torch.Tensor, weight, bias, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, or LayerNorm when there is a bias."""
    if bias is None:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def dropout_add(residual: torch.Tensor, y: torch.Tensor, p: float) -> torch.Tensor:
    """residual + dropout(y) (training, p > 0), or residual + y."""
    return residual + (F.dropout(y, p, True) if p > 0.0 else y)


def add_norm(residual, y, weight, bias, eps: float, p: float):
    """(x, norm(x)) for x = residual + dropout(y): the attention's residual and the pre-MLP
    norm."""
    x = dropout_add(residual, y, p)
    return x, norm(x, weight, bias, eps)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; y [s, b, 2 * f] is fc1's output, gate then up ([s, b, f])."""
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, n, s, d] (or [b, g, n/g, s, d]); cos, sin [s, d] or [b, 1, s, d] broadcast over
    x's heads (halves rotated, as Megatron and Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def rope_qk(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embeddings of queries [b, n, s, d] or [b, g, n/g, s, d] (heads by key group) and
    keys [b, g, s, d]."""
    q_cos, q_sin = (cos, sin)
    if q.dim() == 5 and cos.dim() == 4:  # per-sample tables [b, 1, s, d]
        q_cos, q_sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return apply_rope(q, q_cos, q_sin), apply_rope(k, cos, sin)


class _SwiGLU(torch.autograd.Function):
    """SwiGLU whose forward is `forward_fn` (compiled) and whose backward is one pass that
    writes both halves of fc1's gradient (swiglu_kernels.py); it keeps fc1's output alone."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, forward_fn: Callable) -> torch.Tensor:
        ctx.save_for_backward(y)
        return forward_fn(y)  # without gradients: the compiled inference graph

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        from megadyn.models.swiglu_kernels import swiglu_backward

        (y,) = ctx.saved_tensors
        return swiglu_backward(y, dh), None


def fused_swiglu(y: torch.Tensor, forward_fn: Callable) -> torch.Tensor:
    """silu(gate) * up with `forward_fn` (swiglu, compiled) forward and the one-pass backward."""
    return _SwiGLU.apply(y, forward_fn)


@functools.cache
def _compiled(fn: Callable, backend: str) -> Callable:
    return torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)


@dataclass(frozen=True)
class Fusions:
    """Which pointwise regions of the block run compiled (GPTConfig.pointwise_fusion and the
    switches of its parts)."""

    norm: bool = False
    """RMSNorm / LayerNorm, and with `residual` the pre-MLP norm joined to the residual add."""
    swiglu: bool = False
    """silu(gate) * up."""
    rope: bool = False
    """Rotary embeddings of queries and keys."""
    residual: bool = False
    """The residual adds with their hidden dropout."""
    backend: str | None = None
    """torch.compile's backend; None: inductor for CUDA tensors, the plain function
    elsewhere. A name compiles on any device (the CPU tests take 'aot_eager_decomp_partition':
    inductor's decompositions and partitioner, run eagerly)."""

    @classmethod
    def from_config(cls, cfg) -> Fusions:
        """The regions that `cfg` (a GPTConfig) turns on and its block has."""
        if not cfg.pointwise_fusion:
            return cls()
        return cls(
            norm=cfg.norm_fusion,
            swiglu=cfg.bias_swiglu_fusion and cfg.activation == "swiglu",
            rope=cfg.apply_rope_fusion and cfg.position_embedding_type == "rope",
            residual=cfg.bias_dropout_fusion,
        )

    @property
    def label(self) -> str | None:
        """'norm+swiglu+rope+residual' for the regions on; None for none."""
        parts = [p for p in ("norm", "swiglu", "rope", "residual") if getattr(self, p)]
        return "+".join(parts) or None

    def __call__(self, on: bool, fn: Callable, x: torch.Tensor) -> Callable:
        """`fn` compiled when `on` and its tensors are like `x` on CUDA (or `backend` is
        set); `fn` itself otherwise."""
        if not on or (self.backend is None and not x.is_cuda):
            return fn
        return _compiled(fn, self.backend or "inductor")
