"""Hot switching (--dynamic-parallelism): a step's samples run in length groups, each under the
layout that suits its lengths, over the same processes.

At the start the length planner (megadyn/elastic/planning/lengths.py) picks, from the cost and
memory models, which tp x dp layout runs which sample lengths and each layout's micro-batch
token budget. The job's own layout (the base) keeps the model, the optimizer and the gradient
buffers of record; every other layout of the plan gets its own groups and a copy of the model
(weights and a gradient buffer, no optimizer), made once.

A step at data cursor c with global batch G:

1. every rank reads the lengths of samples c .. c + G - 1 from the index and the plan sorts
   them into groups; a group's samples are dealt over that layout's data-parallel ranks by
   their model FLOPs (attention's square term included; `split_by_weight`), so every sample is
   drawn once, by one data-parallel rank of one group (its tp ranks read it too);
2. the loss tokens of the whole batch are summed over the processes (one small all-reduce), so
   each micro batch's loss is scaled as in token_steps.py with its group's micro-batch count
   and dp size: the step's loss is the mean over the batch's real tokens, as in a static run;
3. groups run base first, then by tp: a switch copies the base weights into the layout's copy
   (`LayoutSwitch.weights_to_other`), its micro batches run and its gradients are reduced over
   its dp, and a switch back adds them to the base layout's buffers (`grads_to_base`). The
   base buffers are reduced over the base dp before that, so what is added (the same on every
   rank) is not averaged again;
4. one optimizer step in the base layout (the trainer's).

    hot = HotSwitch.build(cfg, model_cfg, groups, chunks, device)   # build_layout_parts
    loss, tokens = hot.gradients(parts, global_batch, iteration)    # HotSwitchStep (steps.py)
    hot.records[-1]     # HotStep: groups, layouts, switches, switch seconds (printed, and a
                        # `dynamic_parallelism` record in the metrics file, each step)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megadyn.core.distributed import DistributedDataParallel, finalize_model_grads
from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.core.pipeline import forward_backward
from megadyn.core.tensor_parallel import RNGTracker
from megadyn.data.token_budget import split_by_weight
from megadyn.elastic.planning.lengths import LengthPlan, plan_length_groups
from megadyn.models import build_gpt_chunks
from megadyn.models.config import GPTConfig
from megadyn.models.flops import model_flops_per_iteration
from megadyn.training.build import no_sync
from megadyn.training.config import MegadynConfig
from megadyn.training.layout_switch import LayoutSwitch
from megadyn.training.token_steps import global_token_loss

GiB = 2**30
DEVICE_SHARE = 0.9
"""The part of a GPU's memory the length planner plans for by default."""


@dataclass
class OtherLayout:
    """A layout of the plan other than the base: its groups and model copy."""

    groups: ParallelGroups
    chunks: list[torch.nn.Module]
    ddp: list[DistributedDataParallel]
    switch: LayoutSwitch


@dataclass(frozen=True)
class GroupStep:
    """One length group of one step."""

    layout: Layout
    samples: int
    shortest: int
    longest: int
    seconds: float = 0.0
    """Its micro batches and gradient reduction (switches not included)."""


@dataclass
class HotStep:
    """What one step ran (the per-step log line)."""

    iteration: int
    groups: list[GroupStep] = field(default_factory=list)
    switches: int = 0
    switch_seconds: float = 0.0

    def to_dict(self) -> dict:
        """The metrics file's `dynamic_parallelism` record of the step."""
        groups = [
            dict(layout=f"tp{g.layout.tp}xdp{g.layout.dp}", samples=g.samples,
                 shortest=g.shortest, longest=g.longest, seconds=g.seconds)
            for g in self.groups
        ]  # fmt: skip
        return dict(
            iteration=self.iteration,
            groups=groups,
            switches=self.switches,
            switch_seconds=self.switch_seconds,
        )

    def describe(self) -> str:
        parts = [
            f"{g.samples} samples of {g.shortest}-{g.longest} tokens under "
            f"tp{g.layout.tp}xdp{g.layout.dp} in {g.seconds * 1e3:.1f} ms"
            for g in self.groups
        ]
        return (
            f" dynamic parallelism: iteration {self.iteration}: {'; '.join(parts)}; "
            f"{self.switches} switches in {self.switch_seconds * 1e3:.1f} ms"
        )


def planner_memory_gib(cfg: MegadynConfig, device: torch.device) -> float:
    """--dynamic-parallelism-memory-gib, else 90% of the device's memory (unbounded on the
    CPU)."""
    asked = cfg.training.dynamic_parallelism_memory_gib
    if asked is not None:
        return asked
    if device.type == "cuda":  # what the allocator's fragmentation and the context leave
        return DEVICE_SHARE * torch.cuda.get_device_properties(device).total_memory / GiB
    return float("inf")


class _Interval:
    """The time from its creation to `stop()`: on CUDA between two events on the current
    stream (the step never waits on the host for it), read once the step's work is queued;
    elsewhere the host clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.begin.record()
        else:
            self.begin = time.perf_counter()

    def stop(self) -> _Interval:
        if self.cuda:
            self.end.record()
        else:
            self.end = time.perf_counter()
        return self

    def seconds(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.begin.elapsed_time(self.end) / 1e3
        return self.end - self.begin


def _timed(move, device: torch.device) -> _Interval:
    """Run `move` (a switch); its _Interval."""
    interval = _Interval(device)
    move()
    return interval.stop()


class HotSwitch:
    """The plan, the other layouts' model copies, and the step over them (module docstring)."""

    def __init__(
        self,
        plan: LengthPlan,
        base: ParallelGroups,
        others: dict[int, OtherLayout],
        model_cfg,
        device: torch.device,
    ):
        self.plan, self.base, self.others, self.model_cfg = plan, base, others, model_cfg
        self.device = device
        self.drawn: list[int] = []
        """Global sample indices this rank read as tp rank 0 of its group's layout."""
        self.records: list[HotStep] = []

    @classmethod
    def build(
        cls,
        cfg: MegadynConfig,
        model_cfg: GPTConfig,
        groups: ParallelGroups,
        chunks: list[torch.nn.Module],
        device: torch.device,
    ) -> HotSwitch:
        """Plan, then build every other layout's groups (every process, in plan order) and
        model copy."""
        t = cfg.training
        plan = plan_length_groups(
            model_cfg,
            groups.layout,
            budget=t.micro_batch_tokens,
            seq_length=cfg.data.seq_length,
            global_batch_size=t.global_batch_size,
            gpu_memory_gib=planner_memory_gib(cfg, device),
            recompute=t.recompute,
            distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        )
        others = {}
        for k, group in enumerate(plan.groups):
            if group.layout == groups.layout:
                continue
            other = ParallelGroups.build(group.layout, groups.grid.members, groups.backend)
            tracker = RNGTracker.create(t.seed, other.tp_rank, 0, device)
            copies = build_gpt_chunks(
                model_cfg, other, recompute_cfg=t.recompute, tracker=tracker, device=device
            )
            ddp = [DistributedDataParallel(c, other.dp_group) for c in copies]
            switch = LayoutSwitch(model_cfg, chunks[0], groups, copies[0], other)
            others[k] = OtherLayout(other, copies, ddp, switch)
        return cls(plan, groups, others, model_cfg, device)

    def describe_plan(self) -> str:
        parts = [
            f"{g.describe()} (micro batches <= {g.max_tokens} tokens)" for g in self.plan.groups
        ]
        return " dynamic parallelism: " + "; ".join(parts)

    def release(self) -> None:
        for other in self.others.values():
            for d in other.ddp:
                d.remove_hooks()
            other.groups.destroy()
        self.others = {}

    def _groups(self, k: int) -> ParallelGroups:
        return self.others[k].groups if k in self.others else self.base

    def gradients(self, parts, global_batch: int, iteration: int) -> tuple[torch.Tensor, int]:
        """Run the step after `iteration` over the base layout's `parts` (layout_parts.py) and
        the other layouts' copies; the gradients end in the base layout's buffers. Returns the
        step's loss (mean over the batch's loss tokens, on every rank) and its token count."""
        loader = parts.train_loader
        start = loader.consumed_samples
        indices = range(start, start + global_batch)
        lengths = [loader.sample_length(i) for i in indices]
        record = HotStep(iteration + 1)
        shares, about = {}, {}
        for k, positions in enumerate(self.plan.assign(lengths)):
            if not positions:
                continue
            g = self._groups(k)
            flops = [model_flops_per_iteration(self.model_cfg, 1, lengths[p]) for p in positions]
            mine = [indices[positions[i]] for i in split_by_weight(flops, g.dp_size)[g.dp_rank]]
            shares[k] = loader.batches_of(mine, self.plan.groups[k].max_tokens)
            if g.tp_rank == 0:
                self.drawn += mine
            group_lengths = [lengths[p] for p in positions]
            about[k] = (g.layout, len(positions), min(group_lengths), max(group_lengths))
        loader.consumed_samples = start + global_batch
        counted = sum(s.tokens for k, s in shares.items() if self._groups(k).tp_rank == 0)
        total = int(self._sum_over_members(counted))
        loss_sum, timed, switches = 0.0, [], []
        for k, step in shares.items():  # base first (the plan's order)
            part, interval = self._run_group(parts, k, step.batches, total, switches)
            loss_sum += part
            timed.append((about[k], interval))
        loss = self._sum_over_members(loss_sum)
        record.groups = [GroupStep(*group, interval.seconds()) for group, interval in timed]
        record.switches = len(switches)
        record.switch_seconds = sum(interval.seconds() for interval in switches)
        self.records.append(record)
        return torch.tensor(loss, device=self.device), total

    def _run_group(self, parts, k: int, batches, total: int, switches: list):
        """One group's micro batches under its layout; returns this rank's part of the step's
        loss (counted on tp rank 0) and their _Interval; the switches' go into `switches`."""
        other = self.others.get(k)
        g = self._groups(k)
        ddp = parts.ddp if other is None else other.ddp
        if other is not None:
            switches.append(_timed(other.switch.weights_to_other, self.device))
            for d in ddp:
                d.zero_grad_buffer()
        n, part = len(batches), 0.0
        interval = _Interval(self.device)
        if n:
            losses = forward_backward(
                ddp,
                g,
                iter(batches),
                n,
                config=parts.pipeline_cfg,
                loss_fn=global_token_loss(total, n, g.dp_size),
                no_sync=lambda: no_sync(ddp),
                loss_scale=parts.optimizer.loss_scale,
            )
            if g.tp_rank == 0:  # each micro batch's value is its token sum x n x dp / total
                part = float(torch.stack([x.detach().float() for x in losses]).sum()) / (
                    n * g.dp_size
                )
        finalize_model_grads(ddp, g)  # a rank without micro batches still takes part
        interval.stop()
        if other is not None:
            switches.append(_timed(other.switch.grads_to_base, self.device))
        return part, interval

    def _sum_over_members(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self.base.members_group)
        return float(t.item())
