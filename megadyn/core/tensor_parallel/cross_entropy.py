"""Cross entropy over logits split along the vocabulary, without gathering them.

Each rank holds logits [s, b, V_local] for vocabulary rows [vocab_start, vocab_start + V_local).
The max, the softmax denominator and the target logit are reduced over the tp group, so only
three [s, b] tensors cross the network. Both paths keep, for the backward, the input logits
(in their own dtype, bf16 in training) and fp32 [s, b] statistics, never an fp32 softmax; the
backward recomputes the softmax from them.

    fused=False  eager torch: the max is all-reduced first, then exp-sum and target logit are
                 taken against it (the CPU path, and the reference the fused one is tested on)
    fused=True   Triton kernels (cross_entropy_kernels.py): one pass over the logits gives each
                 rank's local max m, local sum s of exp(l - m) and raw target logit t; then
                 M = max over tp of m, S = sum over tp of s * exp(m - M), T = sum over tp of t,
                 loss = log S + M - T. The backward is one pass too: it reads the logits once
                 and writes (exp(l - M) / S - onehot(target)) * grad_loss in their dtype.

The fused path needs CUDA logits (or Triton's interpreter); the model picks it by default where
the logits are on a GPU (GPTConfig.fused_loss).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megadyn.core.tensor_parallel.mappings import group_size


def _all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def _all_reduce_sum_pair(a: torch.Tensor, b: torch.Tensor, group):
    """Sum two same-shaped tensors over the group with one all-reduce."""
    if group_size(group) == 1:
        return a, b
    stacked = torch.stack([a, b])  # [2, s, b]
    dist.all_reduce(stacked, group=group)
    return stacked.unbind(0)


def _exp_sum_and_target(logits, logits_max, local_target, outside):
    """sum_v exp(l_v - max) and l_target - max (0 where the target is another rank's)."""
    shifted = logits.to(torch.float32, copy=True).sub_(logits_max.unsqueeze(-1))  # [s, b, V/tp]
    target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
    target_logit = target_logit.masked_fill(outside, 0.0)
    sum_exp = shifted.exp_().sum(dim=-1)
    return target_logit, sum_exp


def _grad_logits(logits, logits_max, sum_exp, local_target, outside, grad_loss):
    """(softmax - onehot(target)) * grad_loss, in the logits' dtype."""
    grad = logits.to(torch.float32, copy=True).sub_(logits_max.unsqueeze(-1))  # [s, b, V/tp]
    grad.exp_().div_(sum_exp.unsqueeze(-1))
    vocab = torch.arange(grad.shape[-1], device=grad.device)  # [V/tp]
    onehot = (vocab == local_target.unsqueeze(-1)) & ~outside.unsqueeze(-1)  # [s, b, V/tp]
    grad.sub_(onehot.to(grad.dtype))
    return grad.mul_(grad_loss.unsqueeze(-1)).to(logits.dtype)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Eager torch; fp32 copies of the logits live only inside each stage."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        logits_max = _all_reduce_max(logits.float().max(dim=-1).values, group)  # [s, b] fp32
        vocab_end = vocab_start + logits.shape[-1]
        outside = (target < vocab_start) | (target >= vocab_end)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit, sum_exp = _all_reduce_sum_pair(
            *_exp_sum_and_target(logits, logits_max, local_target, outside), group
        )
        ctx.save_for_backward(logits, logits_max, sum_exp, local_target, outside)
        return sum_exp.log() - target_logit  # [s, b]

    @staticmethod
    def backward(ctx, grad_loss):
        logits, logits_max, sum_exp, local_target, outside = ctx.saved_tensors
        grad = _grad_logits(logits, logits_max, sum_exp, local_target, outside, grad_loss)
        return grad, None, None, None


def _kernels():
    try:
        from megadyn.core.tensor_parallel import cross_entropy_kernels
    except ImportError as e:  # triton comes with torch's CUDA builds
        raise ImportError(
            "the fused cross entropy needs Triton; install it or use fused=False "
            "(--no-cross-entropy-loss-fusion)"
        ) from e
    return cross_entropy_kernels


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """Triton kernels: one pass over the logits forward, one backward. Logits that an
    operation produced (not a leaf) take their gradient in place: the backward writes it over
    the saved logits, which nothing needs afterwards, so the step's peak (the start of the
    backward) holds one [s, b, V/tp] tensor, not two (as Megatron's cross entropy reuses its
    saved softmax). A second backward through the same graph is refused."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        kernels = _kernels()
        local_max, local_sum, target_logit = kernels.row_statistics(logits, target, vocab_start)
        logits_max = _all_reduce_max(local_max.clone(), group)  # [s, b] fp32
        sum_exp, target_logit = _all_reduce_sum_pair(
            local_sum * (local_max - logits_max).exp(), target_logit, group
        )
        ctx.vocab_start = vocab_start
        ctx.overwrite = logits.grad_fn is not None  # a leaf's values belong to the caller
        ctx.overwritten = False
        ctx.save_for_backward(logits, target, logits_max, sum_exp)
        return sum_exp.log() + logits_max - target_logit  # [s, b]

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.overwritten:
            raise RuntimeError(
                "the fused cross entropy wrote its gradient over the saved logits: a second "
                "backward through it (retain_graph) needs --no-cross-entropy-loss-fusion"
            )
        logits, target, logits_max, sum_exp = ctx.saved_tensors
        grad = _kernels().grad_logits(
            logits, target, ctx.vocab_start, logits_max, sum_exp, grad_loss,
            overwrite=ctx.overwrite,
        )  # fmt: skip
        ctx.overwritten = ctx.overwrite
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits, target, vocab_start: int, group, fused: bool = False
) -> torch.Tensor:
    """Per-token loss [s, b] (float32) from local logits [s, b, V_local] and targets [s, b].

    `fused` runs the Triton kernels (CUDA logits; same math, one pass each way); an error, not
    a silent fallback, where they cannot run.
    """
    function = _FusedVocabParallelCrossEntropy if fused else _VocabParallelCrossEntropy
    return function.apply(logits, target, vocab_start, group)
