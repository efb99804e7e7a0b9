"""The spine of every change of layout: one `Transition`, run by one function.

    t = Transition.of(rec)                    # an operator's request, a drain, a join (controller)
    t = decision.transition()                 # a failure: the survivors' decision (recovery)
    done = run_transition(t, trainer, env, ...)    # PLAN -> MOVE -> REBUILD: done.trainer

    PLAN     the span's group and the new layout's groups (every live process builds them), the
             reshard plan from where the state comes from
    MOVE     the executor: tensors go from their holders to the new layout's ranks
    REBUILD  the trainer drops the old layout or builds (or joins) the new one, adopts the moved
             tensors and the layout-free scalars, and takes the RNG streams of its coordinates

Where each piece of state comes from (`Transition.origin`):
- "live": the old members' tensors as they train (a request, a drain, a join);
- "replicas": tensors the survivors of a failure salvaged (`Transition.sources`), each read from
  one of its holdings (`Transition.holding`: 0 the layout it trained under, k the k-th replica
  it kept from before a recovery whose first step has not finished; recovery/recovery.py);
- "snapshot": no survivor holds a replica; the newest in-memory snapshot is loaded instead.

Nothing else in megadyn/elastic calls the reshard executor or rebuilds a trainer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megadyn.core.distributed import default_bucket_size
from megadyn.core.hetero_layout import HeteroLayout
from megadyn.core.layout import Layout
from megadyn.elastic.config import JobConfig
from megadyn.elastic.control.records import Reconfiguration
from megadyn.elastic.planning.hetero_job import build_groups, describe_layout_state
from megadyn.elastic.recovery.agreement import RecoveryError
from megadyn.elastic.recovery.watched_store import watching_failures
from megadyn.elastic.reshard.description import DistOpt, StateDescription
from megadyn.elastic.reshard.executor import execute_plan
from megadyn.elastic.reshard.plan import Plan, plan_between
from megadyn.models.config import GPTConfig

if TYPE_CHECKING:
    from megadyn.elastic.control.protocol import ReshardableTrainer
    from megadyn.elastic.recovery.retired_groups import RetiredGroups


@dataclass(frozen=True, kw_only=True)
class Transition:
    """One change of layout, the same on every live process."""

    old_layout: Layout | HeteroLayout
    old_members: tuple[int, ...]
    layout: Layout | HeteroLayout
    members: tuple[int, ...]
    training: dict
    """The JSON of the trainer's TrainingState the new layout goes on from."""
    vocab_size: int
    """The model's vocabulary as trained (the tokenizer's)."""
    release: tuple[int, ...] = ()
    """Processes that leave the job (they exit) rather than wait as standby."""
    sources: tuple[int, ...] | None = None
    """The processes read from: None, every old member's live tensors; else the survivors of a
    failure whose salvaged tensors are at the agreed step (empty: the snapshot)."""
    holding: Mapping[int, int] = field(default_factory=dict)
    """For each source: which of its holdings it reads (0: the tensors of the layout it
    trained under; k: the k-th replica it kept from before an unfinished recovery)."""
    missing: str | None = None
    """Why no survivor's tensors serve (origin "snapshot")."""

    @classmethod
    def of(cls, rec: Reconfiguration) -> Transition:
        """The transition of a reconfiguration of the running layout (live tensors)."""
        return cls(
            old_layout=rec.old_layout,
            old_members=tuple(rec.old_members),
            layout=rec.layout,
            members=tuple(rec.members),
            training=rec.training,
            vocab_size=rec.vocab_size,
            release=tuple(rec.release),
        )

    @property
    def origin(self) -> str:
        """Where the state comes from: "live", "replicas" or "snapshot"."""
        if self.sources is None:
            return "live"
        return "replicas" if self.sources else "snapshot"

    @property
    def span(self) -> list[int]:
        """The processes that take part in the move: those read from and the new members."""
        read = self.old_members if self.sources is None else self.sources
        return sorted(set(read) | set(self.members))


@dataclass(frozen=True)
class TransitionTimes:
    """Seconds of a transition's phases on this process."""

    plan_s: float
    """The preparation, the groups and the reshard plan."""
    move_s: float
    """The executor's moves."""
    rebuild_s: float
    """The trainer's release, rebuild or join, the adoption, the RNG streams and the groups'
    teardown."""
    total_s: float


@dataclass(frozen=True)
class Transitioned:
    """What a transition leaves this process with."""

    trainer: ReshardableTrainer | None
    """The trainer it runs next (None: it left the layout)."""
    plan: Plan | None
    """The reshard plan (None: the state came from a snapshot)."""
    times: TransitionTimes


@dataclass(frozen=True)
class TransitionEnv:
    """What every transition of this process runs with (the controller builds it once)."""

    model_cfg: GPTConfig
    """The model's config (its vocabulary is replaced by the transition's)."""
    distopt_of: Callable[[Layout | HeteroLayout], DistOpt | None]
    device: torch.device
    round_bytes: int
    """Bytes a process moves per round of the executor (--elastic-reshard-chunk-mb)."""
    timeout: timedelta
    """The new groups' collectives' timeout (--distributed-timeout-minutes)."""
    make_trainer: Callable[[object, dict], ReshardableTrainer]
    """A standby process's trainer for the new groups, at the progress of the training JSON."""
    resume: Callable[[ReshardableTrainer], bool]
    """Load the newest in-memory snapshot into the trainer; False when there is none."""


@dataclass
class _Groups:
    """PLAN's groups: the new layout's and the span's (None: the world group serves)."""

    groups: object
    span_group: object | None


def run_transition(
    t: Transition,
    trainer: ReshardableTrainer | None,
    env: TransitionEnv,
    *,
    prepare: Callable[[], None] | None = None,
    connect_timeout: timedelta | None = None,
    watch: Callable[[], bool] | None = None,
    restore_rng: Callable[[ReshardableTrainer], None] | None = None,
    salvaged=None,
    created: list | None = None,
    retired: RetiredGroups | None = None,
) -> Transitioned:
    """PLAN -> MOVE -> REBUILD on this process: its trainer next (None: it left the layout),
    the plan (None: from a snapshot) and the phases' seconds.

    `prepare` runs first, timed with PLAN; groups are created within `connect_timeout` (then
    set to `env.timeout`) while `watch()` tells that a peer died (PeerGone ends the wait);
    `restore_rng(trainer)` hands over RNG streams after a move; `salvaged` holds a survivor's
    tensors (origin "replicas"); groups created go into `created` (a recovery drops them when
    another failure cuts it short); the old layout's groups go to `retired` (None: a recovery
    destroyed them already)."""
    t0 = time.perf_counter()
    if prepare is not None:
        prepare()
    made = connect(t, env, connect_timeout, watch, created)
    plan = None if t.origin == "snapshot" else reshard_plan(env, t)
    t_plan = time.perf_counter()
    new_state = move(t, plan, env, made.span_group, trainer, salvaged)
    t_move = time.perf_counter()
    trainer = rebuild(t, env, made, trainer, new_state, restore_rng, created, retired)
    t_done = time.perf_counter()
    times = TransitionTimes(t_plan - t0, t_move - t_plan, t_done - t_move, t_done - t0)
    return Transitioned(trainer, plan, times)


def connect(t: Transition, env: TransitionEnv, connect_timeout, watch, created) -> _Groups:
    """The span's group and the new layout's groups (every live process creates them)."""
    # the move runs over the world group when every process of the job takes part (its
    # communicator exists already); else over a group of the span, which every live process
    # creates (see groups.py): processes outside it (standby processes sitting the change out)
    # never enter the move's collectives
    whole_world = t.span == list(range(dist.get_world_size()))
    timeout = connect_timeout or env.timeout
    with watching_failures(watch) if watch is not None else nullcontext():
        span_group = None if whole_world else dist.new_group(t.span, timeout=timeout)
        if created is not None and span_group is not None:
            created.append(span_group)
        groups = build_groups(t.layout, t.members, timeout=timeout)
        if created is not None:
            created.append(groups)
    if connect_timeout is not None:
        groups.set_timeout(env.timeout)
    return _Groups(groups, span_group)


def reshard_plan(env: TransitionEnv, t: Transition) -> Plan:
    """The plan that builds the new layout from where `t`'s state comes from (PlanError when
    some piece has no holder among the sources)."""
    return plan_from(
        env.model_cfg.with_(vocab_size=t.vocab_size),
        env.distopt_of,
        t.old_layout,
        t.old_members,
        t.layout,
        t.members,
        t.sources,
    )


def plan_from(
    model_cfg: GPTConfig, distopt_of, old_layout, old_members, layout, members, sources=None
):
    """The reshard plan from `old_layout` over `old_members` to `layout` over `members`,
    reading only from `sources` (None: every old member)."""
    old = describe_layout_state(model_cfg, old_layout, old_members, distopt_of(old_layout))
    new = describe_layout_state(model_cfg, layout, members, distopt_of(layout))
    if sources is not None:
        old = restrict(old, sources)
    return plan_between(old, new)


def restrict(desc: StateDescription, holders) -> StateDescription:
    """`desc` with only the pieces that `holders` hold: the replicas a recovery may read."""
    keep = set(holders)
    return StateDescription(desc.tensors, {r: p for r, p in desc.pieces.items() if r in keep})


def move(t: Transition, plan, env: TransitionEnv, span_group, trainer, salvaged) -> dict:
    """MOVE: tensors go from old to new holders; returns this rank's new ones."""
    rank = dist.get_rank()
    if plan is None or rank not in t.span:
        return {}
    if t.origin == "live":
        local = trainer.export_state() if trainer is not None else {}
    else:
        held = t.holding.get(rank)
        local = salvaged.holding(held).tensors if held is not None else {}
    return execute_plan(
        plan, local.__getitem__, group=span_group, device=env.device, round_bytes=env.round_bytes
    )


def rebuild(t: Transition, env, made: _Groups, trainer, new_state, restore_rng, created, retired):
    """REBUILD: drop the old layout, build (or join) the new one around `new_state`; returns
    this process's trainer, None when it left the layout."""
    rank = dist.get_rank()
    old_groups = None if trainer is None else trainer.groups
    if trainer is not None and rank not in t.members:
        trainer.release()
    if rank not in t.members:
        trainer = None
    elif trainer is None:  # a standby process joins
        trainer = env.make_trainer(made.groups, t.training)
    else:
        trainer.rebuild(made.groups, t.training)
    if trainer is not None and t.origin == "snapshot":
        if not env.resume(trainer):
            raise RecoveryError(f"{t.missing}, and no in-memory snapshot to load")
    elif trainer is not None:
        trainer.take(new_state, t.training)
        if restore_rng is not None:
            restore_rng(trainer)
    if made.span_group is not None:
        dist.destroy_process_group(made.span_group)
        if created is not None:
            created.remove(made.span_group)
    if retired is None or old_groups is None:
        return trainer
    if trainer is None:  # it leaves the layout: nothing waits
        old_groups.destroy()
    else:  # destroyed beside the second step (recovery/retired_groups.py)
        retired.hold(old_groups)
    return trainer


def distopt_of(cfg: JobConfig, layout: Layout) -> DistOpt | None:
    """How the job's distributed optimizer shards under `layout` (None: it is off)."""
    if not cfg.optimizer.use_distributed_optimizer:
        return None
    shards = layout.dp * layout.cp  # the distributed optimizer shards over dp x cp
    return DistOpt(bucket_size=default_bucket_size(cfg.parallel.overlap_grad_reduce, shards))
