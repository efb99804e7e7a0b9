"""Cross entropy over logits split along the vocabulary, without gathering them.

Each rank holds logits [s, b, V_local] for vocabulary rows [vocab_start, vocab_end). The max,
the softmax denominator and the target logit are reduced over the tp group, so only three
[s, b] tensors cross the network.

Memory and passes: the forward keeps the input logits (in their own dtype, bf16 in training)
and the [s, b] statistics, not an fp32 softmax; the backward recomputes the softmax from them.
Each elementwise stage is a small function which `fused=True` hands to `torch.compile`, so
that a stage is one pass over the logits (max; exp-sum and target logit; softmax minus one-hot
times the loss gradient, cast back) instead of an fp32 copy and five passes over it. The eager
path computes the same expressions in the same order as the unfused formula.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from megadyn.core.tensor_parallel.mappings import group_size


def _local_max(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().max(dim=-1).values  # [s, b]


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
    # minus the one-hot target as an elementwise compare (a scatter would make the compiled
    # kernel materialize an fp32 [s, b, V/tp] buffer); x - 1 and x - 0 round as x + (-1), x + 0
    vocab = torch.arange(grad.shape[-1], device=grad.device)  # [V/tp]
    onehot = (vocab == local_target.unsqueeze(-1)) & ~outside.unsqueeze(-1)  # [s, b, V/tp]
    grad.sub_(onehot.to(grad.dtype))
    return grad.mul_(grad_loss.unsqueeze(-1)).to(logits.dtype)


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def _kernel(fn, fused: bool):
    return _compiled(fn) if fused else fn


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group, fused):
        logits_max = _kernel(_local_max, fused)(logits)  # [s, b] fp32
        if group_size(group) > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        vocab_end = vocab_start + logits.shape[-1]
        outside = (target < vocab_start) | (target >= vocab_end)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit, sum_exp = _kernel(_exp_sum_and_target, fused)(
            logits, logits_max, local_target, outside
        )
        if group_size(group) > 1:
            stacked = torch.stack([target_logit, sum_exp])  # one all-reduce for both
            dist.all_reduce(stacked, group=group)
            target_logit, sum_exp = stacked.unbind(0)
        loss = sum_exp.log() - target_logit  # [s, b]
        ctx.fused = fused
        ctx.save_for_backward(logits, logits_max, sum_exp, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, logits_max, sum_exp, local_target, outside = ctx.saved_tensors
        grad = _kernel(_grad_logits, ctx.fused)(
            logits, logits_max, sum_exp, local_target, outside, grad_loss.contiguous()
        )
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits, target, vocab_start: int, group, fused: bool = False
) -> torch.Tensor:
    """Per-token loss [s, b] (float32) from local logits [s, b, V_local] and targets [s, b].

    `fused` compiles the elementwise stages with `torch.compile` (a CUDA speed-up; same math).
    """
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, group, fused)
