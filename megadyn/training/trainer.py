"""The training loop of pretrain_gpt.py.

    trainer = Trainer(cfg, groups, device, hooks=[...])  # tokenizer, data, model, optimizer
    trainer.load(path)                          # or read + adopt (megadyn/launch resumes)
    losses = trainer.train()                    # per-iteration lm loss (on the logging rank)

Everything that depends on the layout is made in `build(groups)`, so the elastic controller can
call it again with new groups; the data cursor (`state.consumed_samples`) and the global batch
size do not depend on the layout. The job runtime (megadyn/launch) runs its snapshots,
heartbeats and elastic controller as step hooks (hooks.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megadyn.core.distributed import finalize_model_grads
from megadyn.core.pipeline import MicroBatchGraph, check_cuda_graph, forward_backward
from megadyn.data.sampler import micro_batch_indices
from megadyn.data.token_budget import step_share
from megadyn.models import lm_loss_for
from megadyn.training import checkpoint as ckpt
from megadyn.training.arguments import dump_args
from megadyn.training.build import build_model_parts, no_sync
from megadyn.training.checkpoint_items import (
    rng_streams,
    set_rng_streams,
)
from megadyn.training.config import MegadynConfig
from megadyn.training.data_setup import build_datasets, build_loader
from megadyn.training.evaluation import evaluate
from megadyn.training.hetero_step import HeteroStep
from megadyn.training.hooks import StepHook, as_hooks
from megadyn.training.hot_switch import HotSwitch
from megadyn.training.iteration_log import log_window
from megadyn.training.metrics_log import MetricsLog
from megadyn.training.microbatches import MicroBatchCalculator
from megadyn.training.scheduler import LRScheduler
from megadyn.training.state import TrainingState, TrainState
from megadyn.training.tensors import adopt_tensors, export_tensors
from megadyn.training.token_steps import draw_token_step
from megadyn.training.validation import check_variable_lengths
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
        self.draws: list[
            tuple[int, int, int, int]
        ] = []  # (cursor, dp rank, dp size, micro batches; global batch under token budgets;
        # first sample, 0, samples for a replica of a heterogeneous layout)
        self.wandb = create_wandb_logger(
            self.cfg, dist.get_rank(), dist.get_world_size(), print_fn=self.print
        )
        self.metrics_log = MetricsLog.from_config(self.cfg)  # on the logging rank of the time
        self.build(groups, init_weights=init_weights)

    # --- layout-dependent parts ----------------------------------------------------------------
    def build(self, groups, init_weights: bool = True) -> None:
        """Model chunks, DDP wrappers, optimizer, scheduler and loaders for `groups` (again
        after a reconfiguration; the weights then come from `adopt_state`)."""
        cfg = self.cfg
        self.groups = groups
        for hook in self.hooks:  # e.g. host buffers of the old layout's snapshots go
            hook.new_layout(self)
        self.hetero = HeteroStep.of(groups, cfg)  # replicas of different depth; None: a grid
        if self.hetero is None:
            self.microbatches.check_dp_size(groups.dp_size)
            check_variable_lengths(cfg, groups.layout)  # a planner's layout too
        parts = build_model_parts(
            cfg,
            self.model_cfg,
            self.model_groups,
            self.device,
            init_weights=init_weights,
            stage_layers=self.hetero.stage_layers if self.hetero else None,
        )
        self.tracker, self.chunks, self.ddp = parts.tracker, parts.chunks, parts.ddp
        self.optimizer, self.pipeline_cfg = parts.optimizer, parts.pipeline_cfg
        self.loss_fn = lm_loss_for(groups.cp_group)  # over whole sequences under cp
        previous = getattr(self, "scheduler", None)
        self.scheduler = LRScheduler.from_config(
            cfg.scheduler, cfg.optimizer, self.train_iters, optimizer=self.optimizer
        )
        if previous is not None:  # rebuilt under a new layout: the schedule goes on
            self.scheduler.load_state_dict(previous.state_dict())
        self.train_loader = self._train_loader()
        self.cuda_graph = None if self.hetero else self._cuda_graph(groups.layout)
        if self.hetero is None:
            self._log_distopt_instances(groups.layout)
        self._build_hot_switch(groups)

    def _build_hot_switch(self, groups) -> None:
        """--dynamic-parallelism: the length plan and its other layouts' model copies."""
        previous = getattr(self, "hot", None)
        if previous is not None:
            previous.release()
        self.hot = None
        if self.cfg.training.dynamic_parallelism:
            self.hot = HotSwitch.build(self.cfg, self.model_cfg, groups, self.chunks, self.device)
            if self.logs:
                self.print(self.hot.describe_plan(), flush=True)

    @property
    def model_groups(self):
        """The groups the model, its schedule and optimizer run on: the layout's, or this
        rank's replica's in a heterogeneous layout (hetero_step.py)."""
        return self.groups if self.hetero is None else self.hetero.replica

    def _train_loader(self):
        args = (self.data.train, self.cfg)
        consumed, documents = self.state.consumed_samples, self.data.documents
        if self.hetero is not None:  # this replica's block of each step's micro batches
            return self.hetero.loader(*args, consumed, documents)
        g = self.groups
        return build_loader(*args, g.dp_rank, g.dp_size, consumed, documents)

    def _log_distopt_instances(self, layout) -> None:
        """Say so when a layout runs with fewer optimizer copies than the job asked for (a live
        change to a dp x cp that --num-distributed-optimizer-instances does not divide)."""
        asked = self.cfg.parallel.num_distributed_optimizer_instances
        if layout.distopt_instances != asked and self.logs:
            self.print(
                f" distributed optimizer: 1 instance under dp={layout.dp} cp={layout.cp}, "
                f"which --num-distributed-optimizer-instances {asked} does not divide: the "
                "optimizer shards have no replicas until a layout it divides",
                flush=True,
            )

    def _cuda_graph(self, layout) -> MicroBatchGraph | None:
        """A new (uncaptured) micro-batch graph for this layout under --enable-cuda-graph; None
        where the layout cannot be captured (a planner's pp > 1 after a reconfiguration)."""
        t, m = self.cfg.training, self.model_cfg
        if not t.enable_cuda_graph:
            return None
        if layout.pp > 1:  # only a layout the elastic planner chose (validate refuses others)
            if self.logs:
                self.print(f" CUDA graph off under {layout}: a graph covers a single stage")
            return None
        check_cuda_graph(
            pp=layout.pp,
            vpp=layout.vpp,
            dropout=max(m.hidden_dropout, m.attention_dropout),
            recompute=t.recompute.granularity,
            device=self.device,
        )
        return MicroBatchGraph(t.cuda_graph_warmup_steps)

    # --- live reshard (megadyn/elastic) ---------------------------------------------------------
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
            self.draws = [d for d in self.draws if d[0] < self.state.consumed_samples]
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

    @property
    def samples_drawn(self) -> list[int]:
        """Global sample indices this rank's data-parallel replica read (tp 0, cp 0, first
        stage)."""
        mbs = self.cfg.training.micro_batch_size
        if self.hot is not None:  # each group's samples are dealt by the length plan
            return list(self.hot.drawn)
        if self.token_budget:  # the draw records the global batch
            return [i for c, r, dp, gbs in self.draws for i in step_share(c, r, dp, gbs)]
        return [
            i
            for consumed, dp_rank, dp_size, n in self.draws
            for i in (
                range(dp_rank, dp_rank + n)  # a replica's block of a heterogeneous layout
                if dp_size == 0
                else (
                    i
                    for j in range(n)
                    for i in micro_batch_indices(
                        consumed + j * mbs * dp_size, dp_rank, dp_size, mbs
                    )
                )
            )
        ]

    def params_ready(self) -> None:
        """Wait for the parameter all-gathers left running by the last step (--overlap-param-
        gather); needed before params are read outside a forward pass."""
        for d in self.ddp:
            d.finish_param_gather()

    def drop_cuda_graph(self) -> None:
        """Free the captured graph; call before the groups' communicators are destroyed (NCCL
        waits for the graphs that use a communicator). The next step captures again."""
        if self.cuda_graph is not None:
            self.cuda_graph.reset()

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

    def salvage(self) -> tuple[dict[str, torch.Tensor], bool]:
        """A peer died: this rank's tensors of training state, read without communication,
        and whether they are those of `iteration` (False when a step stopped inside the
        optimizer's update); then everything that refers to the old groups goes (`release`)."""
        tensors = export_tensors(self.chunks, self.optimizer, self.cfg.optimizer)
        for hook in self.hooks:  # e.g. a snapshot being written over the old groups
            hook.abandon(self)
        self.release()
        return tensors, not self.updating

    @property
    def logs(self) -> bool:
        """This rank prints and reports: the last rank of the layout (last stage), as Megatron."""
        return self.groups.rank == self.groups.grid.members[-1]

    # --- one step ------------------------------------------------------------------------------
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
        scale = self.optimizer.loss_scale
        losses = forward_backward(
            self.ddp,
            self.model_groups,
            batches,
            n,
            config=self.pipeline_cfg,
            loss_fn=loss_fn or self.loss_fn,
            no_sync=self._no_sync,
            cuda_graph=self.cuda_graph,
            loss_scale=self.hetero.loss_scale(scale) if self.hetero else scale,
        )
        if self.hetero is not None:
            self.hetero.finish_grads(self.ddp)
        else:
            finalize_model_grads(self.ddp, self.groups)
        return losses

    def train_step(self) -> tuple[torch.Tensor | None, bool, float | None]:
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
        if g.tp_rank == g.cp_rank == g.pp_rank == 0:  # one small record per step, expanded later
            if self.hetero is not None:  # (cursor, first sample, 0, samples): one block
                block = self.train_loader.samples(consumed)
                self.draws.append((consumed, block.start, 0, len(block)))
            else:
                self.draws.append((consumed, g.dp_rank, g.dp_size, gbs if self.token_budget else n))
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
        applied, grad_norm, _ = self.optimizer.step()
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

    # --- loop ----------------------------------------------------------------------------------
    def train(self) -> list[float]:
        """Train to --train-iters; returns the per-iteration losses on the logging rank."""
        t, log_every = self.cfg.training, self.cfg.logging.log_interval
        history, window, start = [], [], time.perf_counter()
        last_norm = None
        while self.state.iteration < self.train_iters:
            loss, applied, grad_norm = self.train_step()
            if loss is not None:
                window.append((self.state.iteration, loss))
            last_norm = grad_norm if applied else last_norm
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
        return evaluate(self)

    # --- checkpoints ---------------------------------------------------------------------------
    def meta(self) -> dict:
        """What a checkpoint records beside the tensors (progress, schedule, arguments)."""
        return {**self.training_state().to_dict(), "args": dump_args(self.cfg)}

    def save(self) -> None:
        self.finish_saves()
        self.params_ready()
        c = self.cfg.checkpoint
        meta = self.meta()
        self._pending = ckpt.save_checkpoint(
            c.save,
            self.state.iteration,
            self.chunks,
            self.optimizer,
            self.groups,
            meta,
            keep_last=c.keep_last,
            async_save=c.async_save,
        )
        if self.logs:
            self.print(
                f" saving checkpoint at iteration {self.state.iteration} to {c.save}", flush=True
            )

    # --- finishing saves; loading (megadyn/launch resumes a snapshot or --load with these) ---
    def finish_saves(self) -> None:
        pending = getattr(self, "_pending", None)
        if pending is not None and pending.future is not None:
            pending.finish()
        self._pending = None

    def load(self, path: str) -> None:
        self.adopt(self.read(path))

    def read(self, path: str) -> ckpt.ReadCheckpoint:
        """Read a checkpoint or snapshot for this layout without touching the model (so it may
        run in a thread beside megadyn/launch/warm_up.py)."""
        c = self.cfg.checkpoint
        return ckpt.read_checkpoint(
            path,
            self.chunks,
            self.optimizer,
            self.groups,
            load_optim=not (c.no_load_optim or c.finetune),
            load_rng=not c.no_load_rng,
        )

    def adopt(self, read: ckpt.ReadCheckpoint) -> None:
        """Put a read checkpoint into the model, optimizer, schedule and data cursor."""
        c = self.cfg.checkpoint
        if not c.finetune and "scheduler" in read.meta:  # Megatron's rule, or a ConfigError
            saved = read.meta["scheduler"]
            read.meta["scheduler"] = self.scheduler.resume_state(saved, self.cfg.scheduler)
        meta = ckpt.apply_checkpoint(read, self.chunks, self.optimizer, self.groups)
        self.load_training_state(
            TrainingState.from_dict(meta),
            progress=not c.finetune and "state" in meta,
            optimizer=meta["optim_restored"],
        )
        if self.logs:
            self.print(
                f" loaded checkpoint {read.path} at iteration {self.state.iteration} "
                f"(optimizer state {'restored' if meta['optim_restored'] else 'not restored'}, "
                f"RNG {'restored' if meta['rng_restored'] else 'reseeded'})",
                flush=True,
            )
