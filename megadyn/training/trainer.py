"""The training loop of pretrain_gpt.py.

    trainer = Trainer(cfg, groups, device, hooks=[...])  # tokenizer, data, model, optimizer
    trainer.load(path)                          # or read + adopt (megadyn/launch resumes)
    losses = trainer.train()                    # per-iteration lm loss (on the logging rank)

Everything that depends on the layout is made in `build(groups)`, so the elastic controller can
call it again with new groups; the data cursor (`state.consumed_samples`) and the global batch
size do not depend on the layout. The job runtime (megadyn/launch) runs its snapshots,
heartbeats and elastic controller as step hooks (hooks.py).

The class is split by responsibility over files of its own: the step (trainer_step.py), its
state as reshards, recovery and snapshots see it (trainer_state.py), checkpoints
(trainer_checkpoints.py), the log of what it drew (draws.py), the iteration line
(iteration_log.py) and evaluation (evaluation.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megadyn.core.pipeline import MicroBatchGraph, check_cuda_graph
from megadyn.models import lm_loss_for
from megadyn.training.build import build_model_parts
from megadyn.training.config import MegadynConfig
from megadyn.training.data_setup import build_datasets, build_loader
from megadyn.training.draws import Draw, drawn_samples
from megadyn.training.evaluation import evaluate
from megadyn.training.hetero_step import HeteroStep
from megadyn.training.hooks import StepHook, as_hooks
from megadyn.training.hot_switch import HotSwitch
from megadyn.training.iteration_log import log_window
from megadyn.training.metrics_log import MetricsLog
from megadyn.training.microbatches import MicroBatchCalculator
from megadyn.training.scheduler import LRScheduler
from megadyn.training.state import TrainState
from megadyn.training.straggler_log import StragglerLog
from megadyn.training.trainer_checkpoints import TrainerCheckpoints
from megadyn.training.trainer_state import TrainerState
from megadyn.training.trainer_step import TrainerStep
from megadyn.training.validation import check_variable_lengths
from megadyn.training.wandb_logger import create_wandb_logger


class Trainer(TrainerStep, TrainerState, TrainerCheckpoints):
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
        self.hot: HotSwitch | None = None  # --dynamic-parallelism (hot_switch.py)
        self._pending = None  # a checkpoint being saved (trainer_checkpoints.py)
        self.wandb = create_wandb_logger(
            self.cfg, dist.get_rank(), dist.get_world_size(), print_fn=self.print
        )
        self.metrics_log = MetricsLog.from_config(self.cfg)  # on the logging rank of the time
        self.stragglers = StragglerLog(self.cfg, self.device)  # --log-straggler's step parts
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
            cfg, self.model_cfg, groups, self.device, init_weights=init_weights
        )
        self.tracker, self.chunks, self.ddp = parts.tracker, parts.chunks, parts.ddp
        self.optimizer, self.pipeline_cfg = parts.optimizer, parts.pipeline_cfg
        self.loss_fn = lm_loss_for(groups.cp_group)  # over whole sequences under cp
        previous = self.scheduler
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
        self.stragglers.new_layout(self)

    def _build_hot_switch(self, groups) -> None:
        """--dynamic-parallelism: the length plan and its other layouts' model copies."""
        if self.hot is not None:
            self.hot.release()
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
        for d in self.ddp:
            d.finish_param_gather()

    def drop_cuda_graph(self) -> None:
        """Free the captured graph; call before the groups' communicators are destroyed (NCCL
        waits for the graphs that use a communicator). The next step captures again."""
        if self.cuda_graph is not None:
            self.cuda_graph.reset()

    @property
    def logs(self) -> bool:
        """This rank prints and reports: the last rank of the layout (last stage), as Megatron."""
        return self.groups.rank == self.groups.grid.members[-1]

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
        self.stragglers.timer.skip_next()  # the next step is slow for everyone
        return evaluate(self)

    @property
    def straggler_scores(self):
        """The last interval's straggler verdict (straggler_log.py); None before one."""
        return self.stragglers.latest
