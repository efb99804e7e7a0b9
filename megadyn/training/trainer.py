"""The training loop of pretrain_gpt.py.

    trainer = Trainer(cfg, groups, device, hooks=[...])  # tokenizer, data, model, optimizer
    trainer.load(path)                          # or read + adopt (megadyn/launch resumes)
    losses = trainer.train()                    # per-iteration lm loss (on the logging rank)
    result = trainer.train_step()               # one step: a StepResult (steps.py)

The Trainer is composed of parts it builds and collaborators it holds:
- `parts` (layout_parts.py): everything that depends on the layout (model chunks, DDP,
  optimizer, pipeline config, loader, CUDA graph, hot switch) and the layout's kind of step
  (steps.py), made in `build(groups)` by one function, so the elastic controller can build
  them again with new groups;
- `checkpoints` (trainer_checkpoints.py): saving and loading;
- what does not depend on the layout stays here: the data cursor and counters (`state`), the
  learning-rate schedule, the log of what it drew (draws.py) and its losses.
It is the elastic controller's `ReshardableTrainer` (megadyn/elastic/control/protocol.py): reshards,
recovery and snapshots read and write its state through the methods under "state". The job runtime (megadyn/launch) runs its snapshots, heartbeats
and elastic controller as step hooks (hooks.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megadyn.core.optimizer import OptimizerStep, StepInterrupted
from megadyn.training.arguments import dump_args
from megadyn.training.checkpoint_items import rng_streams, set_rng_streams
from megadyn.training.config import MegadynConfig
from megadyn.training.data_setup import build_datasets
from megadyn.training.draws import Draw, drawn_samples, draws_before
from megadyn.training.evaluation import evaluate
from megadyn.training.hooks import StepHook, as_hooks
from megadyn.training.iteration_log import log_window
from megadyn.training.layout_parts import LayoutParts, build_layout_parts
from megadyn.training.metrics_log import MetricsLog
from megadyn.training.microbatches import MicroBatchCalculator
from megadyn.training.scheduler import LRScheduler
from megadyn.training.state import TrainingState, TrainState
from megadyn.training.steps import StepResult
from megadyn.training.straggler_log import StragglerLog
from megadyn.training.tensors import adopt_tensors, export_tensors
from megadyn.training.trainer_checkpoints import Checkpoints
from megadyn.training.wandb_logger import create_wandb_logger


class Trainer:
    def __init__(
        self,
        cfg: MegadynConfig,
        groups,
        device,
        *,
        state: TrainState | None = None,
        init_weights: bool = True,
        hooks: Sequence[StepHook | Callable] = (),
        print_fn=print,
    ):
        self.device, self.print = torch.device(device), print_fn
        self.data = build_datasets(cfg, group=None if state is not None else groups.members_group)
        # the tokenizer decides the vocabulary; checkpoints record the model as trained
        self.cfg = dataclasses.replace(
            cfg, model=cfg.model.with_(vocab_size=self.data.tokenizer.vocab_size)
        )
        self.model_cfg = self.cfg.model
        self.microbatches = MicroBatchCalculator.from_config(cfg.training)
        self.state = state or TrainState()
        self.train_iters = cfg.training.train_iters
        self.hooks = as_hooks(hooks)  # in this order at every step boundary
        self.loss_by_iteration: dict[int, float] = {}
        self.updating = False  # inside the optimizer's update (recovery.py reads it)
        self.step_done = None  # CUDA: an event recorded after the last step's work
        self.step_seconds: float | None = None  # measured at the last log line
        self.window_tokens = 0  # real tokens since the last log line (--micro-batch-tokens)
        self.draws: list[Draw] = []  # one record per step (draws.py)
        self.scheduler: LRScheduler | None = None  # made by build, kept across layouts
        self.parts: LayoutParts | None = None  # made by build for each layout
        self.checkpoints = Checkpoints(print_fn)
        self.wandb = create_wandb_logger(
            self.cfg, dist.get_rank(), dist.get_world_size(), print_fn=self.print
        )
        self.metrics_log = MetricsLog.from_config(self.cfg)  # on the logging rank of the time
        self.stragglers = StragglerLog(self.cfg, self.device)  # --log-straggler's step parts
        self.build(groups, init_weights=init_weights)

    # --- layout-dependent parts (layout_parts.py) ---------------------------------------------
    def build(self, groups, init_weights: bool = True) -> None:
        """The layout's parts for `groups` (again after a reconfiguration; the weights then
        come from `take`), and the schedule bound to their optimizer."""
        self.groups = groups
        for hook in self.hooks:  # e.g. host buffers of the old layout's snapshots go
            hook.new_layout(self)
        if self.parts is not None and self.parts.hot is not None:
            self.parts.hot.release()  # its groups go before the new layout's copies come
        self.parts = build_layout_parts(
            self.cfg,
            self.model_cfg,
            groups,
            self.device,
            self.data,
            self.state.consumed_samples,
            self.microbatches,
            init_weights=init_weights,
            say=self._say if self.logs else None,
        )
        self.parts.timer = self.stragglers.timer
        self.stragglers.new_layout(self)
        previous = self.scheduler
        cfg = self.cfg
        self.scheduler = LRScheduler.from_config(
            cfg.scheduler, cfg.optimizer, self.train_iters, optimizer=self.parts.optimizer
        )
        if previous is not None:  # rebuilt under a new layout: the schedule goes on
            self.scheduler.load_state_dict(previous.state_dict())

    def _say(self, line: str) -> None:
        self.print(line, flush=True)

    # what the rest of megadyn reads of the current layout's parts
    chunks = property(lambda self: self.parts.chunks if self.parts else None)
    ddp = property(lambda self: self.parts.ddp if self.parts else None)
    optimizer = property(lambda self: self.parts.optimizer if self.parts else None)
    train_loader = property(lambda self: self.parts.train_loader if self.parts else None)
    pipeline_cfg = property(lambda self: self.parts.pipeline_cfg if self.parts else None)
    loss_fn = property(lambda self: self.parts.loss_fn if self.parts else None)
    hot = property(lambda self: self.parts.hot if self.parts else None)

    @property
    def token_budget(self) -> bool:
        """Micro batches are cut by --micro-batch-tokens (token_steps.py)."""
        return self.cfg.training.micro_batch_tokens is not None

    @property
    def samples_drawn(self) -> list[int]:
        """Global sample indices this rank's data-parallel replica read (tp 0, cp 0, first
        stage)."""
        if self.hot is not None:  # each group's samples are dealt by the length plan
            return list(self.hot.drawn)
        return drawn_samples(self.draws, self.cfg.training.micro_batch_size, self.token_budget)

    def params_ready(self) -> None:
        """Wait for the parameter all-gathers left running by the last step (--overlap-param-
        gather); needed before params are read outside a forward pass."""
        self.parts.params_ready()

    def drop_cuda_graph(self) -> None:
        """Free the captured graph; call before the groups' communicators are destroyed (NCCL
        waits for the graphs that use a communicator). The next step captures again."""
        if self.parts is not None:
            self.parts.drop_cuda_graph()

    @property
    def logs(self) -> bool:
        """This rank prints and reports: the last rank of the layout (last stage), as Megatron."""
        return self.groups.rank == self.groups.grid.members[-1]

    # --- the step (steps.py) ------------------------------------------------------------------
    def train_step(self) -> StepResult:
        """One step of the layout's kind (steps.py) and its counters."""
        step = self.parts.step
        self.stragglers.timer.begin()  # the step's parts (rank_timing.py)
        draw = step.draw(self.state.consumed_samples)
        if draw is not None:  # one small record per step (draws.py)
            self.draws.append(draw)
        result = step.run(self.state, self._update)
        self.window_tokens += result.tokens
        if result.hot is not None and self.logs:
            self.print(result.hot.describe(), flush=True)
            self.metrics_log.event("dynamic_parallelism", result.hot.to_dict())
        return result

    def _update(self) -> OptimizerStep:
        """The optimizer step after the gradients are final, and the step's counters."""
        consumed = self.state.consumed_samples
        self.updating = True  # until the step is counted: the tensors are between two steps
        try:
            done = self.parts.optimizer.step()
        except StepInterrupted:
            self.updating = False  # it stopped before changing anything
            raise
        if done.applied:
            self.scheduler.step(1)
        else:
            self.state.skipped_iterations += 1
        if done.applied and done.grad_norm is not None and not math.isfinite(done.grad_norm):
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
        return done

    # --- loop ----------------------------------------------------------------------------------
    def train(self) -> list[float]:
        """Train to --train-iters; returns the per-iteration losses on the logging rank."""
        t, log_every = self.cfg.training, self.cfg.logging.log_interval
        history, window, start = [], [], time.perf_counter()
        last_norm = None
        while self.state.iteration < self.train_iters:
            result = self.train_step()
            if result.loss is not None:
                window.append((self.state.iteration, result.loss))
            last_norm = result.grad_norm if result.applied else last_norm
            it = self.state.iteration
            if it % log_every == 0 or it == self.train_iters:
                history += log_window(
                    self, window, last_norm, time.perf_counter() - start, len(window) or 1
                )
                window, start = [], time.perf_counter()
            if t.eval_interval and it % t.eval_interval == 0 and self.data.valid is not None:
                self.evaluate()
            if (
                self.cfg.checkpoint.save
                and self.cfg.checkpoint.save_interval
                and it % self.cfg.checkpoint.save_interval == 0
            ):
                self.save()
            if t.exit_interval and it % t.exit_interval == 0:
                break
            for hook in self.hooks:  # snapshots, heartbeats, the elastic controller (which
                hook.after_step(self)  # may rebuild this trainer)
        if self.cfg.checkpoint.save and (
            not self.cfg.checkpoint.save_interval
            or self.state.iteration % self.cfg.checkpoint.save_interval
        ):
            self.save()
        self.params_ready()
        for hook in self.hooks:  # e.g. the running snapshot completes
            hook.end(self)
        self.finish_saves()
        self.wandb.finish()
        return history

    def evaluate(self) -> float | None:
        """Validation loss over --eval-iters (megadyn/training/evaluation.py)."""
        self.stragglers.timer.skip_next()  # the next step is slow for everyone
        return evaluate(self)

    @property
    def straggler_scores(self):
        """The last interval's straggler verdict (straggler_log.py); None before one."""
        return self.stragglers.latest

    # --- checkpoints (trainer_checkpoints.py) --------------------------------------------------
    def meta(self) -> dict:
        """What a checkpoint records beside the tensors (progress, schedule, arguments)."""
        return {**self.training_state().to_dict(), "args": dump_args(self.cfg)}

    def save(self) -> None:
        self.stragglers.timer.skip_next()  # the next step is slow for everyone
        self.checkpoints.save(self.cfg, self.parts, self.state.iteration, self.meta(), self.logs)

    def finish_saves(self) -> None:
        """Wait for an asynchronous save still being written."""
        self.checkpoints.finish(self.logs)

    def load(self, path: str) -> None:
        self.adopt(self.read(path))

    def read(self, path: str, flag: str = "--load"):
        """Read a checkpoint or snapshot for this layout without touching the model (so it may
        run in a thread beside megadyn/launch/warm_up.py); errors are led by `flag`."""
        return self.checkpoints.read(self.cfg, self.parts, path, flag)

    def adopt(self, read) -> None:
        """Put a read checkpoint into the model, optimizer, schedule and data cursor."""
        meta = self.checkpoints.apply(self.cfg, self.parts, read, self.scheduler)
        self.load_training_state(
            TrainingState.from_dict(meta),
            progress=not self.cfg.checkpoint.finetune and "state" in meta,
            optimizer=meta["optim_restored"],
        )
        if self.logs:
            self.checkpoints.say_loaded(read, meta, self.state.iteration)

    # --- state: tensors (tensors.py) and layout-free scalars (state.py) ----------------------
    def export_state(self) -> dict[str, torch.Tensor]:
        """This rank's tensors of training state by global key (megadyn/training/tensors.py)."""
        self.params_ready()
        return export_tensors(self.chunks, self.optimizer, self.cfg.optimizer)

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

    # --- the elastic controller's view (megadyn/elastic/control/protocol.py) --------------------------
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
        adopt_tensors(self.chunks, self.optimizer, tensors)
        self.load_training_state(TrainingState.from_dict(training))

    def log_event(self, name: str, event: dict) -> None:
        self.wandb.log_event(name, event, step=event["iteration"])
        self.metrics_log.event(name, event)

    @property
    def built(self) -> bool:
        """It holds a layout's model and optimizer (not `release`d)."""
        return self.parts is not None

    def release(self) -> None:
        """Drop the layout-dependent parts (this process leaves the layout)."""
        if self.parts is not None:
            self.parts.release()
        self.parts = None
        self.scheduler.bind(None)  # it drove the optimizer, which holds groups

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
