"""Cross entropy over logits split along the vocabulary, without gathering them.

Each rank holds logits [s, b, V_local] for vocabulary rows [vocab_start, vocab_end). The max,
the softmax denominator and the target logit are reduced over the tp group, so only three
[s, b] tensors cross the network.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megadyn.core.tensor_parallel.mappings import group_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        ctx.dtype = logits.dtype
        logits = logits.float()  # [s, b, V/tp]
        logits_max = logits.max(dim=-1).values
        if group_size(group) > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        logits = logits - logits_max.unsqueeze(-1)

        vocab_end = vocab_start + logits.shape[-1]
        outside = (target < vocab_start) | (target >= vocab_end)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)

        exp = logits.exp_()
        sum_exp = exp.sum(dim=-1)
        if group_size(group) > 1:
            stacked = torch.stack([target_logit, sum_exp])  # one all-reduce for both
            dist.all_reduce(stacked, group=group)
            target_logit, sum_exp = stacked.unbind(0)
        loss = sum_exp.log() - target_logit  # [s, b]

        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - onehot(target)
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits, target, vocab_start: int, group) -> torch.Tensor:
    """Per-token loss [s, b] (float32) from local logits [s, b, V_local] and targets [s, b]."""
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, group)
