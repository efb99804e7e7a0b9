"""The output layer and its cross entropy a chunk of tokens at a time (--cross-entropy-chunks N).

At a large vocabulary the logits are a step's largest activation: [tokens, V/tp] in bf16, 2 GiB
for a micro batch of 8,192 tokens at 128k, alive from the output GEMM to the start of the
backward, where the step's memory peaks. Split into N chunks of tokens, no more than one chunk's
logits exist at a time:

    forward    per chunk: logits = x_c W^T, the per-token loss (vocab_parallel_cross_entropy),
               the logits dropped; x, W and the targets are kept
    backward   per chunk: the logits computed again (the output GEMM once more: a third more of
               the output layer's FLOPs), their gradient written over them (the cross entropy's
               own backward), then d x_c = d logits_c W and d W += d logits_c^T x_c, added into
               W's main_grad under gradient accumulation fusion (into an fp32 sum otherwise,
               cast to W's dtype once)

    loss = chunked_output_loss(x, weight, target, vocab_start, tp_group, chunks=4, fused=True,
                               fuse=True, sequence_parallel=False)         # [s, b] fp32

The tensor-parallel side is the output layer's: the input all-gathered along the sequence under
sequence parallelism (its gradient reduce-scattered), else copied (its gradient all-reduced);
the loss reduces max, sum and target logit over tp per chunk. The values are those of the
whole GEMM and cross entropy up to the GEMMs' summation order (a chunk's rows may take
another kernel than the whole; d W sums the chunks' products).
"""

from __future__ import annotations

import torch

from megadyn.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megadyn.core.tensor_parallel.mappings import copy_to_region, gather_from_sequence
from megadyn.core.tensor_parallel.wgrad import fuse_wgrad, weight_grad


def _rows(tokens: int, chunks: int) -> list[slice]:
    """`chunks` (at most `tokens`) consecutive slices of nearly equal length over the tokens."""
    n = max(1, min(chunks, tokens))
    bounds = [tokens * i // n for i in range(n + 1)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _loss(logits, target, vocab_start: int, group, fused: bool) -> torch.Tensor:
    """Per-token loss [t] of logits [t, V/tp] (the cross entropy takes [s, b] shapes)."""
    return vocab_parallel_cross_entropy(
        logits[:, None], target[:, None], vocab_start, group, fused
    )[:, 0]


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, vocab_start, group, chunks, fused, fuse):
        losses = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        for rows in _rows(x.shape[0], chunks):
            losses[rows] = _loss(x[rows] @ weight.t(), target[rows], vocab_start, group, fused)
        ctx.save_for_backward(x, weight, target)
        ctx.weight = weight  # the parameter itself, for its main_grad (layers.py says why)
        ctx.args = (vocab_start, group, chunks, fused, fuse)
        return losses

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, target = ctx.saved_tensors
        vocab_start, group, chunks, fused, fuse = ctx.args
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = torch.empty_like(x) if need_x else None
        grad_w = None
        w = weight.detach()
        for rows in _rows(x.shape[0], chunks):
            x_c = x[rows].detach()
            with torch.enable_grad():  # logits made by an operation: the gradient goes over them
                logits = x_c.requires_grad_() @ w.t()
                loss = _loss(logits, target[rows], vocab_start, group, fused)
            (grad_logits,) = torch.autograd.grad(loss, logits, grad_loss[rows])
            if need_x:
                torch.mm(grad_logits, w, out=grad_x[rows])
            if need_w and fuse:
                grad_w = weight_grad(ctx.weight, grad_logits, x_c, True)
            elif need_w:  # an fp32 sum of the chunks' products, one rounding at the end
                if grad_w is None:
                    grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
                grad_w.addmm_(grad_logits.t().float(), x_c.float())
            del logits, grad_logits
        if need_w and not fuse:
            grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, None, None, None, None, None, None


def chunked_output_loss(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    group,
    *,
    chunks: int,
    fused: bool,
    fuse: bool,
    sequence_parallel: bool,
) -> torch.Tensor:
    """Per-token loss [s, b] (fp32) of the output layer on x ([s/tp, b, h] under sequence
    parallelism, else [s, b, h]) against `target` [s, b], `chunks` token chunks at a time;
    `fuse`: the weight gradient may go into `weight.main_grad` (the output layer's gradient
    accumulation fusion, its own weight only)."""
    x = gather_from_sequence(x, group) if sequence_parallel else copy_to_region(x, group)
    s, b, h = x.shape
    loss = _ChunkedLinearCrossEntropy.apply(
        x.reshape(s * b, h),
        weight,
        target.reshape(s * b),
        vocab_start,
        group,
        chunks,
        fused,
        fuse_wgrad(weight, fuse),
    )
    return loss.view(s, b)
