"""Everything a layout builds for training, made once by one function and held as one object.

    parts = build_layout_parts(cfg, model_cfg, groups, device, data, consumed)
    result = parts.step.run(state, update)              # steps.py: this layout's kind of step
    parts.release()                                      # the process leaves the layout

`Trainer.build` (trainer.py) makes the parts for each layout it trains under (again after a
reconfiguration, weights then uninitialized: they arrive through a reshard); the benchmarks
build the same Trainer, so they time the parts and the step that training runs. What does not
depend on the layout (the data cursor, the learning-rate schedule, the run's logs) stays on
the Trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megadyn.core.distributed import DistributedDataParallel
from megadyn.core.optimizer import MixedPrecisionOptimizer
from megadyn.core.pipeline import MicroBatchGraph, PipelineConfig, check_cuda_graph
from megadyn.core.tensor_parallel import RNGTracker
from megadyn.core.tensor_parallel.fp8_cache import weight_caches
from megadyn.models import GPTConfig, lm_loss_for
from megadyn.training.build import build_model_parts, no_sync
from megadyn.training.config import MegadynConfig
from megadyn.training.data_setup import Datasets, build_loader
from megadyn.training.hetero_step import HeteroStep
from megadyn.training.hot_switch import HotSwitch
from megadyn.training.microbatches import MicroBatchCalculator
from megadyn.training.rank_timing import RankTimer
from megadyn.training.steps import choose_step
from megadyn.training.validation import check_variable_lengths


@dataclass
class LayoutParts:
    """What training under one layout runs on (module docstring)."""

    groups: object
    """The layout's groups: a grid's `ParallelGroups` or a heterogeneous layout's
    `HeteroGroups`."""
    hetero: HeteroStep | None
    """This rank's replica in a heterogeneous layout (hetero_step.py); None on a grid."""
    tracker: RNGTracker
    """This rank's tensor-parallel RNG streams."""
    chunks: list[torch.nn.Module]
    """The model chunks this rank holds, one per virtual pipeline stage."""
    ddp: list[DistributedDataParallel]
    """One data-parallel wrapper per chunk."""
    optimizer: MixedPrecisionOptimizer
    """The optimizer over every chunk."""
    pipeline_cfg: PipelineConfig
    """What the pipeline schedule sends between stages."""
    loss_fn: Callable
    """The lm loss of a micro batch (over whole sequences under cp)."""
    train_loader: object
    """This rank's training micro batches from the data cursor the parts were built at."""
    cuda_graph: MicroBatchGraph | None = None
    """The micro-batch graph under --enable-cuda-graph (captured by the first steps)."""
    hot: HotSwitch | None = None
    """The length plan and the other layouts' model copies under --dynamic-parallelism."""
    step: object = field(default=None)
    """This layout's kind of step (steps.py), chosen once when the parts are built."""
    timer: RankTimer = field(default_factory=lambda: RankTimer("cpu", enabled=False))
    """The trainer's timer of the step's parts (--log-straggler, rank_timing.py)."""

    @property
    def model_groups(self):
        """The groups the model, its schedule and optimizer run on: the layout's, or this
        rank's replica's in a heterogeneous layout."""
        return self.groups if self.hetero is None else self.hetero.replica

    def no_sync(self) -> contextlib.ExitStack:
        return no_sync(self.ddp)

    def zero_grads(self) -> None:
        self.optimizer.zero_grad()
        for d in self.ddp:
            d.zero_grad_buffer()

    def params_ready(self) -> None:
        """Wait for the parameter all-gathers left running by the last step (--overlap-param-
        gather); needed before params are read outside a forward pass."""
        for d in self.ddp:
            d.finish_param_gather()

    def drop_cuda_graph(self) -> None:
        """Free the captured graph (the next step captures again); before the groups'
        communicators are destroyed, as NCCL waits for the graphs that use a communicator."""
        if self.cuda_graph is not None:
            self.cuda_graph.reset()

    def release(self) -> None:
        """Drop what refers to the layout's groups: graph, gradient hooks, model copies."""
        self.drop_cuda_graph()
        for d in self.ddp:
            d.remove_hooks()
        if self.hot is not None:
            self.hot.release()
            self.hot = None


def build_layout_parts(
    cfg: MegadynConfig,
    model_cfg: GPTConfig,
    groups,
    device: torch.device,
    data: Datasets,
    consumed: int,
    microbatches: MicroBatchCalculator,
    *,
    init_weights: bool = True,
    say: Callable[[str], None] | None = None,
) -> LayoutParts:
    """Model chunks, DDP wrappers, optimizer, loader at data cursor `consumed`, CUDA graph and
    hot switch for this rank of `groups`, and the step that runs them (steps.py); `say`
    prints a line on the logging rank (None elsewhere)."""
    hetero = HeteroStep.of(groups, cfg)  # replicas of different depth; None: a grid
    if hetero is None:
        microbatches.check_dp_size(groups.dp_size)
        check_variable_lengths(cfg, groups.layout)  # a planner's layout too
    model = build_model_parts(cfg, model_cfg, groups, device, init_weights=init_weights)
    parts = LayoutParts(
        groups=groups,
        hetero=hetero,
        tracker=model.tracker,
        chunks=model.chunks,
        ddp=model.ddp,
        optimizer=model.optimizer,
        pipeline_cfg=model.pipeline_cfg,
        loss_fn=lm_loss_for(groups.cp_group),
        train_loader=_train_loader(cfg, groups, hetero, data, consumed),
    )
    if hetero is None:
        parts.cuda_graph = _cuda_graph(cfg, model_cfg, groups.layout, device, say)
        _say_distopt_instances(cfg, groups.layout, say)
    if parts.cuda_graph is not None:  # replays quantize in the graph: a cache serves the
        for cache in weight_caches(parts.ddp):  # eager warm-up alone, and raises its peak
            cache.enabled = False
    if cfg.training.dynamic_parallelism:
        parts.hot = HotSwitch.build(cfg, model_cfg, groups, parts.chunks, device)
        if say is not None:
            say(parts.hot.describe_plan())
    parts.step = choose_step(cfg, parts, microbatches, device)
    return parts


def _train_loader(cfg: MegadynConfig, groups, hetero: HeteroStep | None, data, consumed: int):
    if hetero is not None:  # this replica's block of each step's micro batches
        return hetero.loader(data.train, cfg, consumed, data.documents)
    return build_loader(data.train, cfg, groups.dp_rank, groups.dp_size, consumed, data.documents)


def _say_distopt_instances(cfg: MegadynConfig, layout, say) -> None:
    """Say so when a layout runs with fewer optimizer copies than the job asked for (a live
    change to a dp x cp that --num-distributed-optimizer-instances does not divide)."""
    asked = cfg.parallel.num_distributed_optimizer_instances
    if layout.distopt_instances != asked and say is not None:
        say(
            f" distributed optimizer: 1 instance under dp={layout.dp} cp={layout.cp}, "
            f"which --num-distributed-optimizer-instances {asked} does not divide: the "
            "optimizer shards have no replicas until a layout it divides"
        )


def _cuda_graph(cfg: MegadynConfig, model_cfg, layout, device, say) -> MicroBatchGraph | None:
    """A new (uncaptured) micro-batch graph for this layout under --enable-cuda-graph; None
    where the layout cannot be captured (a planner's pp > 1 after a reconfiguration)."""
    t, m = cfg.training, model_cfg
    if not t.enable_cuda_graph:
        return None
    if layout.pp > 1:  # only a layout the elastic planner chose (validate refuses others)
        if say is not None:
            say(f" CUDA graph off under {layout}: a graph covers a single stage")
        return None
    check_cuda_graph(
        pp=layout.pp,
        vpp=layout.vpp,
        dropout=max(m.hidden_dropout, m.attention_dropout),
        recompute=t.recompute.granularity,
        device=device,
    )
    return MicroBatchGraph(t.cuda_graph_warmup_steps)
