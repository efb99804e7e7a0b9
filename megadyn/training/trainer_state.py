"""The Trainer's state as the elastic controller, recovery and snapshots read and write it:
this rank's tensors by global key, the layout-free scalars (state.py), and dropping the parts
of a layout this process leaves.

    tensors, ts = trainer.export_state(), trainer.training_state()     # a reshard's source
    trainer.rebuild(groups, ts.to_dict()); trainer.take(tensors, ...)  # its destination

`TrainerState` is a part of `Trainer` (megadyn/training/trainer.py), split off by
responsibility; with it, a Trainer is the elastic controller's `ReshardableTrainer`
(megadyn/elastic/protocol.py).
"""

from __future__ import annotations

import dataclasses

import torch

from megadyn.training.checkpoint_items import rng_streams, set_rng_streams
from megadyn.training.draws import draws_before
from megadyn.training.state import TrainingState
from megadyn.training.tensors import adopt_tensors, export_tensors


class TrainerState:
    """Reading, replacing and dropping the state of `Trainer` (module docstring)."""

    # --- tensors (megadyn/training/tensors.py) --------------------------------------------------
    def export_state(self) -> dict[str, torch.Tensor]:
        """This rank's tensors of training state by global key (megadyn/training/tensors.py)."""
        self.params_ready()
        return export_tensors(self.chunks, self.optimizer, self.cfg.optimizer)

    def adopt_state(self, state: dict[str, torch.Tensor]) -> None:
        """Take weights and optimizer state received from the reshard (after `build`)."""
        adopt_tensors(self.chunks, self.optimizer, state)

    # --- layout-free scalars (megadyn/training/state.py) ---------------------------------------
    def training_state(self) -> TrainingState:
        """Progress, schedule, optimizer step and loss scaler: what checkpoints, snapshots and
        live reconfigurations carry beside the tensors."""
        scaler = self.optimizer.grad_scaler
        return TrainingState(
            progress=dataclasses.replace(self.state),
            scheduler=self.scheduler.state_dict(),
            optimizer_step=self.optimizer.step_count,
            grad_scaler=scaler.state_dict() if scaler is not None else None,
        )

    def load_training_state(
        self, ts: TrainingState, *, progress: bool = True, optimizer: bool = True
    ) -> None:
        """Take `ts` (after `build`): with `progress`, the iteration, data cursor and learning-
        rate schedule; with `optimizer`, the optimizer's step count and loss scaler."""
        if progress:
            self.state = dataclasses.replace(ts.progress)
            self.scheduler.load_state_dict(ts.scheduler, strict=False)
            self.train_loader.consumed_samples = self.state.consumed_samples
            # a recovery may go back: what this rank drew and logged after it is undone
            self.draws = draws_before(self.draws, self.state.consumed_samples)
            for it in [i for i in self.loss_by_iteration if i > self.state.iteration]:
                del self.loss_by_iteration[it]
        if optimizer:
            self.optimizer.step_count = ts.optimizer_step
            scaler = self.optimizer.grad_scaler
            if scaler is not None and ts.grad_scaler:
                scaler.load_state_dict(ts.grad_scaler)

    # --- the elastic controller's view (megadyn/elastic/protocol.py) --------------------------
    @property
    def iteration(self) -> int:
        return self.state.iteration

    def training_state_dict(self) -> dict:
        return self.training_state().to_dict()

    def rng_states(self) -> dict[str, torch.Tensor]:
        return rng_streams(self.chunks)

    def set_rng_states(self, states: dict[str, torch.Tensor]) -> None:
        set_rng_streams(self.chunks, states)

    def quiesce(self) -> None:
        for hook in self.hooks:  # a snapshot being written
            hook.quiesce(self)
        self.drop_cuda_graph()

    def rebuild(self, groups, training: dict) -> None:
        self.state = TrainingState.from_dict(training).progress  # the loaders start there
        self.updating = False
        self.build(groups, init_weights=False)

    def take(self, tensors: dict[str, torch.Tensor], training: dict) -> None:
        self.adopt_state(tensors)
        self.load_training_state(TrainingState.from_dict(training))

    def log_event(self, name: str, event: dict) -> None:
        self.wandb.log_event(name, event, step=event["iteration"])
        self.metrics_log.event(name, event)

    # --- leaving a layout ------------------------------------------------------------------------
    def release(self) -> None:
        """Drop the layout-dependent parts (this process leaves the layout)."""
        self.drop_cuda_graph()
        for d in self.ddp or ():
            d.remove_hooks()
        self.chunks = self.ddp = self.optimizer = self.train_loader = None
        self.tracker = self.pipeline_cfg = self.loss_fn = self.cuda_graph = None
        if self.hot is not None:
            self.hot.release()
            self.hot = None
        self.scheduler.bind(None)  # it drove the optimizer, which holds groups

    @property
    def built(self) -> bool:
        """It holds a layout's model and optimizer (not `release`d)."""
        return self.chunks is not None

    def interrupt(self) -> None:
        """A peer died and the communicators are about to be aborted (another thread): the
        step under way must not update with what they return from now on."""
        if self.optimizer is not None:
            self.optimizer.interrupted = True

    def salvage(self) -> tuple[dict[str, torch.Tensor], bool]:
        """A peer died: this rank's tensors of training state, read without communication,
        and whether they are those of `iteration` (False when a step stopped inside the
        optimizer's update); then everything that refers to the old groups goes (`release`)."""
        tensors = export_tensors(self.chunks, self.optimizer, self.cfg.optimizer)
        for hook in self.hooks:  # e.g. a snapshot being written over the old groups
            hook.abandon(self)
        self.release()
        return tensors, not self.updating
