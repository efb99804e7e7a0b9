"""A step of variable-length micro batches (--micro-batch-tokens): what runs and its loss.

Each data-parallel rank cuts its share of the global batch into its own number of micro
batches (megadyn/data/token_budget.py). The step's loss is the mean over the loss tokens of the
whole global batch, T tokens summed over dp, whatever the grouping. The schedule divides what
it back-propagates by the rank's micro-batch count n and the gradient reduction averages over
dp, so a micro batch's loss value is

    sum(per-token loss x loss_mask) x n x dp / T

which makes the back-propagated sum over the step the global token mean, and the trainer's
report (mean over micro batches, then over dp) that same mean.

    step = draw_token_step(loader, global_batch, groups, device)
    forward_backward(..., iter(step.batches), step.num_microbatches, loss_fn=step.loss_fn)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megadyn.data import TokenBudgetLoader


def global_token_loss(
    total_tokens: int | torch.Tensor, num_microbatches: int, dp_size: int
) -> Callable[[torch.Tensor, dict], torch.Tensor]:
    """The loss function of one step's micro batches (module docstring); `total_tokens` may
    be a device tensor (a 0-dim count), which is then never read on the host."""
    total = torch.as_tensor(total_tokens, dtype=torch.float64).clamp(min=1)
    scale = num_microbatches * dp_size / total  # 0-dim fp64, rounded to the loss's dtype

    def loss(per_token_loss: torch.Tensor, batch: dict) -> torch.Tensor:
        mask = batch["loss_mask"].to(per_token_loss.dtype)
        return (per_token_loss * mask).sum() * scale.to(per_token_loss.dtype)

    return loss


@dataclass
class TokenStep:
    """This rank's part of one step of variable-length micro batches."""

    batches: list[dict[str, torch.Tensor]]
    """Collated micro batches ([b_i, s_i] tensors), in order."""
    loss_fn: Callable[[torch.Tensor, dict], torch.Tensor]
    """`global_token_loss` for this step."""
    total_tokens: torch.Tensor
    """Loss tokens of the whole global batch (all dp ranks): a 0-dim int64 tensor on the
    device, read on the host only where the iteration line needs it (iteration_log.py)."""

    @property
    def num_microbatches(self) -> int:
        return len(self.batches)


def draw_token_step(
    loader: TokenBudgetLoader, global_batch: int, groups, device: torch.device, advance=True
) -> TokenStep:
    """The micro batches of the step at the loader's cursor (moved past it with `advance`),
    and their loss function; the token count is all-reduced over `groups.dp_group` and stays
    on the device (no wait for the device per step)."""
    if advance:
        step = loader.next_step(global_batch)
    else:
        step = loader.step_at(loader.consumed_samples, global_batch)
    total = torch.tensor(step.tokens, dtype=torch.int64, device=device)  # 0-dim
    if groups.dp_size > 1:
        dist.all_reduce(total, group=groups.dp_group)
    loss_fn = global_token_loss(total, len(step.batches), groups.dp_size)
    return TokenStep(step.batches, loss_fn, total)
