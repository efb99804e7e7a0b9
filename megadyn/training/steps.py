"""The kinds of training step, one class each, chosen once when a layout's parts are built.

    step = choose_step(cfg, parts, microbatches, device)     # in build_layout_parts
    draw = step.draw(state.consumed_samples)   # what this rank reads (draws.py), or None
    result = step.run(state, update)           # -> StepResult; `update` steps the optimizer

- `GridStep`: the layout's 1F1B (interleaved with vpp > 1) over --global-batch-size's micro
  batches of this data-parallel rank.
- `TemplateStep`: a replica of a heterogeneous layout (pipeline templates) runs its block of
  the step's micro batches; gradients are summed over the replicas (hetero_step.py).
- `TokenBudgetStep`: micro batches cut by --micro-batch-tokens, each rank its own count
  (token_steps.py); the loss is the mean over the global batch's tokens.
- `HotSwitchStep`: length groups under their own layouts (--dynamic-parallelism,
  hot_switch.py).

Each runs forward and backward, makes the gradients final, then calls `update` (the
Trainer's optimizer step and counters), and returns one `StepResult`. The benchmarks time the
same step through `Trainer.train_step`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megadyn.core.distributed import finalize_model_grads
from megadyn.core.optimizer import OptimizerStep
from megadyn.core.pipeline import forward_backward
from megadyn.training.config import MegadynConfig
from megadyn.training.draws import Draw, block_draw
from megadyn.training.hot_switch import HotStep
from megadyn.training.microbatches import MicroBatchCalculator
from megadyn.training.state import TrainState
from megadyn.training.token_steps import draw_token_step

if TYPE_CHECKING:  # layout_parts.py chooses the step
    from megadyn.training.layout_parts import LayoutParts


@dataclass
class StepResult:
    """What one training step did."""

    loss: torch.Tensor | None
    """The step's mean lm loss, a 0-dim device tensor (last-stage ranks; every rank under
    --dynamic-parallelism); None on other ranks."""
    applied: bool
    """The optimizer updated (False: the loss scaler skipped the step)."""
    grad_norm: float | None = None
    """The global gradient norm before clipping (None when skipped)."""
    num_zeros: int | None = None
    """Zeros in the gradients under --log-num-zeros-in-grad."""
    tokens: int | torch.Tensor = 0
    """Real (unpadded) tokens of the global batch under --micro-batch-tokens or
    --dynamic-parallelism (maybe a device count); 0 otherwise."""
    hot: HotStep | None = None
    """Under --dynamic-parallelism: its length groups, switches and their seconds."""


Update = Callable[[], OptimizerStep]
"""The optimizer step after the gradients are final, and the step's counters (Trainer)."""


def gradients(parts: LayoutParts, batches, n: int, loss_fn=None) -> list[torch.Tensor]:
    """Forward and backward of `n` micro batches from `batches`, then the reductions that
    make the gradients final; the micro batches' losses (`loss_fn`: the layout's)."""
    scale, timer = parts.optimizer.loss_scale, parts.timer
    losses = forward_backward(
        parts.ddp,
        parts.model_groups,
        timer.batches(batches),
        n,
        config=parts.pipeline_cfg,
        loss_fn=loss_fn or parts.loss_fn,
        no_sync=parts.no_sync,
        cuda_graph=parts.cuda_graph,
        loss_scale=parts.hetero.loss_scale(scale) if parts.hetero else scale,
    )
    timer.mark("compute")
    if parts.hetero is not None:
        parts.hetero.finish_grads(parts.ddp)
    else:
        finalize_model_grads(parts.ddp, parts.groups)
    timer.mark("grads")
    return losses


def mean_loss(parts: LayoutParts, losses) -> torch.Tensor | None:
    """Mean lm loss of the step over micro batches and dp (on last-stage ranks)."""
    g = parts.groups
    if not g.is_last_stage:
        return None
    if parts.hetero is not None:
        return parts.hetero.mean_loss(losses)
    loss = torch.stack([x.detach().float() for x in losses]).mean()
    if g.dp_size > 1:
        dist.all_reduce(loss, group=g.dp_group)
        loss /= g.dp_size
    return loss


def _records_draws(groups) -> bool:
    """This rank records what its replica draws: tp 0, cp 0 of the first stage."""
    return groups.tp_rank == groups.cp_rank == groups.pp_rank == 0


class GridStep:
    """1F1B (interleaved) over the layout's grid (module docstring)."""

    def __init__(self, parts: LayoutParts, microbatches: MicroBatchCalculator, device):
        self.parts, self.microbatches, self.device = parts, microbatches, device

    def micro_batches(self, consumed: int) -> int:
        return self.microbatches.num_micro_batches(consumed, self.parts.groups.dp_size)

    def draw(self, consumed: int) -> Draw | None:
        """One small record per step on tp 0, cp 0 of the first stage (draws.py)."""
        g = self.parts.groups
        if not _records_draws(g):
            return None
        return Draw(consumed, g.dp_rank, g.dp_size, self.micro_batches(consumed))

    def run(self, state: TrainState, update: Update) -> StepResult:
        consumed = state.consumed_samples
        n = self.micro_batches(consumed)
        self.parts.zero_grads()
        losses = gradients(self.parts, self.parts.train_loader, n)
        return self.finish(losses, update)

    def finish(self, losses, update: Update, tokens: int | torch.Tensor = 0) -> StepResult:
        # the loss's reduction before the update: a step that a failure cuts short after its
        # update (a recovery counts it as done) has its loss on every rank of the replica
        loss = mean_loss(self.parts, losses)
        done = update()
        return StepResult(loss, done.applied, done.grad_norm, done.num_zeros, tokens)


class TemplateStep(GridStep):
    """A replica of a heterogeneous layout runs its block of the step (module docstring)."""

    def micro_batches(self, consumed: int) -> int:
        return self.parts.hetero.micro_batches

    def draw(self, consumed: int) -> Draw | None:
        if not _records_draws(self.parts.groups):
            return None
        return block_draw(consumed, self.parts.train_loader.samples(consumed))


class TokenBudgetStep(GridStep):
    """Micro batches cut by --micro-batch-tokens (module docstring)."""

    def draw(self, consumed: int) -> Draw | None:
        g = self.parts.groups
        if not _records_draws(g):
            return None
        return Draw(consumed, g.dp_rank, g.dp_size, self.microbatches.global_batch_size(consumed))

    def run(self, state: TrainState, update: Update) -> StepResult:
        consumed = state.consumed_samples
        gbs = self.microbatches.global_batch_size(consumed)
        step = draw_token_step(self.parts.train_loader, gbs, self.parts.groups, self.device)
        self.parts.zero_grads()
        losses = gradients(self.parts, iter(step.batches), step.num_microbatches, step.loss_fn)
        return self.finish(losses, update, step.total_tokens)


class HotSwitchStep(GridStep):
    """Length groups under their own layouts (--dynamic-parallelism, hot_switch.py)."""

    def draw(self, consumed: int) -> Draw | None:
        return None  # the hot switch keeps what each group drew (HotSwitch.drawn)

    def run(self, state: TrainState, update: Update) -> StepResult:
        consumed = state.consumed_samples
        self.parts.zero_grads()
        gbs = self.microbatches.global_batch_size(consumed)
        loss, tokens = self.parts.hot.gradients(self.parts, gbs, state.iteration)
        done = update()
        record = self.parts.hot.records[-1]
        return StepResult(loss, done.applied, done.grad_norm, done.num_zeros, tokens, record)


def choose_step(
    cfg: MegadynConfig, parts: LayoutParts, microbatches: MicroBatchCalculator, device
) -> GridStep:
    """The kind of step the job's flags and the layout call for (module docstring)."""
    if parts.hot is not None:
        kind = HotSwitchStep
    elif cfg.training.micro_batch_tokens is not None:
        kind = TokenBudgetStep
    elif parts.hetero is not None:
        kind = TemplateStep
    else:
        kind = GridStep
    return kind(parts, microbatches, device)
