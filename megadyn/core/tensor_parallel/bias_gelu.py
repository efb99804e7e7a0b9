"""Fused bias-GeLU of the GPT-2 MLP: gelu(y + b) for fc1's output y, whose bias b the GEMM
left out (ColumnParallelLinear(..., skip_bias_add=True)).

    z = bias_gelu(y, bias, approximate)   # y [s, b, ffn/tp], bias [ffn/tp]; z like y

Why: in a CUDA-graph bf16 step of the 1.42B reference model on H200 (tokens 4096, ffn 8192,
per layer and micro batch) torch's GeLU forward took 47 us (27 us at memory speed), its
backward 62 us (40 us), then fc1's bias gradient `g.sum(0)` another 31 us reading the whole
gradient again, and a 3 us add into the bias's main_grad: about 27 ms of a 555 ms step.
The Triton kernels (bias_gelu_kernels.py) read y once forward, y and dz once backward, and sum
the bias gradient in fp32 while writing dy, so the separate reduction disappears.

The backward keeps y (not z), as torch's GeLU keeps its input, so activation memory is that of
the plain path. The bias gradient comes back in the bias's dtype through autograd, so the DDP
hook adds it into `main_grad` as it does any bias gradient.

The model takes this path on CUDA bf16/fp16 activations (GPTConfig.bias_gelu_fusion,
--bias-gelu-fusion / --no-bias-gelu-fusion); elsewhere the plain F.gelu runs.
"""

from __future__ import annotations

import torch

from megadyn.core.tensor_parallel.triton_import import triton_kernels


def _kernels():
    return triton_kernels("bias_gelu_kernels", "the fused bias-GeLU", "--no-bias-gelu-fusion")


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias, tanh):
        y2d = y.reshape(-1, y.shape[-1]).contiguous()  # [tokens, ffn/tp]
        ctx.tanh, ctx.shape = tanh, y.shape
        ctx.save_for_backward(y2d, bias)
        return _kernels().forward(y2d, bias, tanh).view(y.shape)

    @staticmethod
    def backward(ctx, grad_z):
        y2d, bias = ctx.saved_tensors
        grad2d = grad_z.reshape(y2d.shape).contiguous()  # [tokens, ffn/tp]
        grad_y, grad_bias = _kernels().backward(grad2d, y2d, bias, ctx.tanh)
        grad_bias = grad_bias if ctx.needs_input_grad[1] else None
        return grad_y.view(ctx.shape), grad_bias, None


def bias_gelu(y: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(y + bias) through the Triton kernels; `approximate` as F.gelu's ('none': erf,
    'tanh'). CUDA tensors (or Triton's interpreter); an error, not a fallback, elsewhere."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return _BiasGelu.apply(y, bias, approximate == "tanh")
