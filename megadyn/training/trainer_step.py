"""One training step of the Trainer (megadyn/training/trainer.py): draw the step's micro
batches, forward and backward through the layout's schedule, reduce the gradients, step the
optimizer and count the step.

    loss, applied, grad_norm = trainer.train_step()    # Trainer.train, once per iteration

`TrainerStep` is a part of `Trainer`, split off by responsibility; it reads the parts that
`Trainer.build` made for the current layout (model chunks, DDP wrappers, optimizer, loaders).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megadyn.core.distributed import finalize_model_grads
from megadyn.core.optimizer import StepInterrupted
from megadyn.core.pipeline import forward_backward
from megadyn.training.build import no_sync
from megadyn.training.draws import Draw, block_draw
from megadyn.training.token_steps import draw_token_step


class TrainerStep:
    """The step of `Trainer` (module docstring)."""

    def _no_sync(self):
        return no_sync(self.ddp)

    def zero_grads(self) -> None:
        self.optimizer.zero_grad()
        for d in self.ddp:
            d.zero_grad_buffer()

    @property
    def token_budget(self) -> bool:
        """Micro batches are cut by --micro-batch-tokens (token_steps.py)."""
        return self.cfg.training.micro_batch_tokens is not None

    def gradients(self, batches, n: int, loss_fn=None) -> list[torch.Tensor]:
        """Forward and backward of `n` micro batches from `batches`, then the reductions that
        make the gradients final; the micro batches' losses (`loss_fn`: the layout's)."""
        scale, timer = self.optimizer.loss_scale, self.stragglers.timer
        losses = forward_backward(
            self.ddp,
            self.model_groups,
            timer.batches(batches),
            n,
            config=self.pipeline_cfg,
            loss_fn=loss_fn or self.loss_fn,
            no_sync=self._no_sync,
            cuda_graph=self.cuda_graph,
            loss_scale=self.hetero.loss_scale(scale) if self.hetero else scale,
        )
        timer.mark("compute")
        if self.hetero is not None:
            self.hetero.finish_grads(self.ddp)
        else:
            finalize_model_grads(self.ddp, self.groups)
        timer.mark("grads")
        return losses

    def train_step(self) -> tuple[torch.Tensor | None, bool, float | None]:
        self.stragglers.timer.begin()  # the step's parts (rank_timing.py)
        consumed = self.state.consumed_samples
        g = self.groups
        batches, loss_fn = self.train_loader, None
        if self.hot is not None:
            return self._hot_step(consumed)
        if self.token_budget:
            gbs = self.microbatches.global_batch_size(consumed)
            step = draw_token_step(self.train_loader, gbs, g, self.device)
            batches, n, loss_fn = iter(step.batches), step.num_microbatches, step.loss_fn
            self.window_tokens += step.total_tokens
        elif self.hetero is not None:
            n = self.hetero.micro_batches
        else:
            n = self.microbatches.num_micro_batches(consumed, g.dp_size)
        if g.tp_rank == g.cp_rank == g.pp_rank == 0:  # one small record per step (draws.py)
            if self.hetero is not None:
                self.draws.append(block_draw(consumed, self.train_loader.samples(consumed)))
            else:
                count = gbs if self.token_budget else n
                self.draws.append(Draw(consumed, g.dp_rank, g.dp_size, count))
        self.zero_grads()
        losses = self.gradients(batches, n, loss_fn)
        # the loss's reduction before the update: a step that a failure cuts short after its
        # update (a recovery counts it as done) has its loss on every rank of the replica
        loss = self._mean_loss(losses)
        applied, grad_norm = self._optimizer_step(consumed)
        return loss, applied, grad_norm

    def _hot_step(self, consumed: int) -> tuple[torch.Tensor, bool, float | None]:
        """A step of length groups under their own layouts (--dynamic-parallelism)."""
        self.zero_grads()
        gbs = self.microbatches.global_batch_size(consumed)
        loss, tokens = self.hot.gradients(self, gbs)
        self.window_tokens += tokens
        if self.logs:
            self.print(self.hot.records[-1].describe(), flush=True)
            self.metrics_log.event("dynamic_parallelism", self.hot.records[-1].to_dict())
        applied, grad_norm = self._optimizer_step(consumed)
        return loss, applied, grad_norm

    def _optimizer_step(self, consumed: int) -> tuple[bool, float | None]:
        """The optimizer step after the gradients are final, and the step's counters."""
        self.updating = True  # until the step is counted: the tensors are between two steps
        try:
            applied, grad_norm, _ = self.optimizer.step()
        except StepInterrupted:
            self.updating = False  # it stopped before changing anything
            raise
        if applied:
            self.scheduler.step(1)
        else:
            self.state.skipped_iterations += 1
        if applied and grad_norm is not None and not math.isfinite(grad_norm):
            self.state.nan_iterations += 1  # every rank sees the same (all-reduced) norm
        self.state.iteration += 1
        self.state.consumed_samples += self.microbatches.global_batch_size(consumed)
        assert self.train_loader.consumed_samples == self.state.consumed_samples, (
            "data cursor drifted"
        )
        self.updating = False
        self.stragglers.timer.mark("update")
        if self.device.type == "cuda":  # when the device is done with this step's work
            self.step_done = self.step_done or torch.cuda.Event()
            self.step_done.record()
        return applied, grad_norm

    def _mean_loss(self, losses) -> torch.Tensor | None:
        """Mean lm loss of the step over micro batches and dp (on last-stage ranks)."""
        if not self.groups.is_last_stage:
            return None
        if self.hetero is not None:
            return self.hetero.mean_loss(losses)
        loss = torch.stack([x.detach().float() for x in losses]).mean()
        if self.groups.dp_size > 1:
            dist.all_reduce(loss, group=self.groups.dp_group)
            loss /= self.groups.dp_size
        return loss
