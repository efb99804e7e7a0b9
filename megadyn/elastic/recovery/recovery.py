"""A failed or hung worker as a live reconfiguration: the survivors stay up.

    recovered = recover(ctx, trainer)     # after a collective raised or PeerFailed

    detect (the runtime: a collective raised, or the agent's failure record was seen)
    -> ABORT   keep this rank's tensors (views, no communication), drop the model, optimizer and
               every process group of the old layout, so the sockets close and every survivor
               still blocked in a collective with this rank raises too (gloo has no abort)
    -> AGREE   through the agent's store (recovery/agreement.py): who is left, the step each survivor's
               tensors are at, and one decision by the lowest surviving member
               (recovery/decision.py)
    -> PLAN    a waiting standby process takes each dead member's place in the same layout;
               else the layout for the survivors' count (requests.replace_or_shrink), keeping
               the global batch; the reshard plan reads only from survivors whose tensors are
               at the agreed step (`restrict`): data-parallel copies, or any other replica the
               state description lists
    -> MOVE    the executor, over a group of the sources and the new members (who first meet
               in the store: `Round.arrive`)
    -> REBUILD groups, model, optimizer, loaders at the agreed step (the data cursor rolls
               back with it, so no sample is drawn twice), RNG streams of a source
    -> RUNNING at most the interrupted step runs again.

Where no survivor holds a piece (dp 1; the distributed optimizer's shard of the dead rank),
the state comes from the newest in-memory snapshot when the runtime has one (`resume`), else
RecoveryError ends this process and torchrun's restart path follows.

A second failure while one is handled starts the agreement over with the larger set of dead
ranks; until the recovery's first step has finished, each survivor also keeps the tensors it
read from (`Salvaged.earlier`, handed on to the next recovery through `RecoveryContext.kept`), so
that a layout the recovery chose without replicas (the planner's pp 2 over two processes, say)
does not lose what the layout before it still held twice. Every wait has a deadline
(`feed.timeout_s`) and watches the failure records: the store polls of the agreement, and the
creation of the new groups (recovery/watched_store.py: their waits for a peer in the store end when a
failure is recorded). The move's collectives end when a peer's sockets close (a dead peer, or a
survivor that aborted its groups to agree again) or after that deadline; the new groups'
collectives get the job's --distributed-timeout-minutes. A move that fails without a further
failure recorded within the deadline is a RecoveryError (the restart path).
"""

from __future__ import annotations

import dataclasses
import gc
import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from socket import gethostname

import torch
import torch.distributed as dist

from megadyn.core import c10d_compat
from megadyn.core.groups import ParallelGroups
from megadyn.core.hetero_groups import HeteroGroups
from megadyn.core.hetero_layout import layout_to_dict
from megadyn.core.layout import Layout
from megadyn.elastic.config import JobConfig
from megadyn.elastic.control.events import FailureEvent, describe_layout
from megadyn.elastic.planning.hetero_job import stage_and_tp
from megadyn.elastic.recovery.agreement import (
    FailureFeed,
    Holding,
    RecoveryError,
    Report,
    Round,
    more_failures,
)
from megadyn.elastic.recovery.decision import (
    NoRecovery,
    RecoveryDecision,
    decide,
    decision_from_dict,
)
from megadyn.elastic.recovery.watched_store import PeerGone
from megadyn.elastic.reshard.plan import PlanError
from megadyn.elastic.transition import TransitionEnv, run_transition
from megadyn.models.config import GPTConfig


@dataclass
class Salvaged:
    """What a member keeps of the old layout once its groups are gone."""

    tensors: dict[str, torch.Tensor]
    iteration: int | None
    """The step its tensors are at; None when a step stopped inside the optimizer's update."""
    training: dict
    rng: bytes
    groups: ParallelGroups
    """The old layout's (destroyed: only its layout and members are read)."""
    model_cfg: GPTConfig
    earlier: list[Salvaged] = dataclasses.field(default_factory=list)
    """What it kept from before the recoveries whose first step has not finished, newest
    first (each at its step: the tensors a recovery hands on are copies)."""

    def holding(self, index: int) -> Salvaged:
        """0: this one; k: the k-th earlier."""
        return self if index == 0 else self.earlier[index - 1]

    def kept_with(self, kept: Salvaged | None) -> Salvaged:
        """This, with `kept` (the salvage a recovery used, its first step unfinished) and what
        `kept` kept as earlier holdings."""
        older = [] if kept is None else [kept, *kept.earlier]
        return dataclasses.replace(self, earlier=[h for h in older if h.iteration is not None])


def abort(trainer, device_done: int | None = None) -> Salvaged:
    """ABORT: this rank's tensors and scalars, then nothing of the old layout is left.
    `device_done`: after an abort of the device communicators, the last step whose device work
    had finished before it; a later step may have used a collective cut short, so tensors
    past it are no step's."""
    if not trainer.built:  # it left its layout halfway through a reconfiguration
        raise RecoveryError("a process failed while the layout was changing")
    buf = io.BytesIO()
    torch.save(trainer.rng_states(), buf)
    training = trainer.training_state_dict()
    tensors, clean = trainer.salvage()
    groups = trainer.groups
    groups.destroy()
    gc.collect()  # gloo closes a group's sockets only once nothing refers to it
    if device_done is not None and trainer.iteration > device_done:
        clean = False
    iteration = trainer.iteration if clean else None
    return Salvaged(tensors, iteration, training, buf.getvalue(), groups, trainer.model_cfg)


def group_count_at_least(n: int) -> None:
    """Every survivor draws the next process-group names from the same count (a failure may
    have cut a round of group creation short on some of them)."""
    c10d_compat.raise_group_count(n)


@dataclass
class RecoveryContext:
    """What a recovery reads of the process it runs on (the controller builds it)."""

    cfg: JobConfig
    """The job's config: the layout rules the decision follows."""
    env: TransitionEnv
    feed: FailureFeed
    live: list[int]
    """The processes that took part in group builds before the failure."""
    kept: Salvaged | None
    """What the last recovery read from, while its first step has not ended."""
    control_rank: int
    """The process whose host serves the control store."""
    rehost: Callable[[int, str, float], None]
    """`rehost(rank, host, timeout_s)`: process `rank` on `host` serves the control store anew;
    the others reach it within `timeout_s`."""


@dataclass
class Recovered:
    """What a recovery leaves this process with."""

    trainer: object | None
    """The trainer it runs next (None: standby)."""
    event: FailureEvent
    live: list[int]
    """The survivors."""
    kept: Salvaged | None
    """What it read from, kept until its first step ends (None: standby)."""


def agree(ctx: RecoveryContext, salvaged: Salvaged | None) -> tuple[Round, list, RecoveryDecision]:
    """AGREE: report, wait for every survivor's report and the decision; start over when more
    failures are recorded meanwhile."""
    rank, feed = dist.get_rank(), ctx.feed
    while True:
        dead = set(feed.dead())
        survivors = [r for r in ctx.live if r not in dead]
        rnd = Round(feed.store, dead)
        rnd.report(_report(rank, salvaged, rnd))
        reports = rnd.wait_reports(survivors, feed, feed.timeout_s)
        if reports is None:
            continue
        deciders = [r for r, rep in reports.items() if rep.member]
        if not deciders:
            raise RecoveryError("no member of the layout survived")
        if rank == min(deciders):
            backend = salvaged.groups.backend
            decision = decide(ctx.cfg, salvaged.model_cfg, backend, reports, dead)
            rnd.decide(decision.to_dict())
        fields = rnd.wait_decision(feed, feed.timeout_s)
        if fields is None:
            continue
        decision = decision_from_dict(fields)
        if isinstance(decision, NoRecovery):
            raise RecoveryError(decision.error)
        return rnd, survivors, decision


def _report(rank: int, salvaged: Salvaged | None, rnd: Round) -> Report:
    """This process's report, after its holdings' RNG streams are published."""
    member = salvaged is not None
    report = Report(rank, member, group_count=c10d_compat.group_count(), host=gethostname())
    if salvaged is None:
        return report
    for k, h in enumerate([salvaged, *salvaged.earlier]):
        rnd.publish(f"rng/{rank}/{k}", h.rng)
    return dataclasses.replace(
        report,
        iteration=salvaged.iteration,
        training=salvaged.training,
        layout=layout_to_dict(salvaged.groups.layout),
        members=list(salvaged.groups.grid.members),
        earlier=[
            Holding(
                h.iteration,
                h.training,
                layout_to_dict(h.groups.layout),
                list(h.groups.grid.members),
            )
            for h in salvaged.earlier
        ],
    )


def move_and_rebuild(
    ctx: RecoveryContext, trainer, salvaged, rnd: Round, decision: RecoveryDecision, created
):
    """PLAN, MOVE and REBUILD by `decision` (transition.py): this process's trainer (None:
    standby), the plan and the phases' seconds. Groups it creates go into `created`
    (dropped if another failure cuts it short: then a RuntimeError)."""
    t, feed = decision.transition(), ctx.feed

    def prepare():  # the survivors first meet in the store: a peer may have died meanwhile
        group_count_at_least(decision.group_count)
        if not rnd.arrive(dist.get_rank(), t.span, feed, feed.timeout_s):
            raise PeerGone("another process failed before the survivors connected")

    def restore(trainer):
        _restore_rng(rnd, trainer, t.old_layout, t.old_members, t.holding)

    # a group's creation waits in the store for each peer: a peer that dies meanwhile ends the
    # wait when its failure is recorded (PeerGone), one that hangs after the recovery's timeout
    # (its watchers kill it sooner); later collectives get the job's timeout
    env = ctx.env
    return run_transition(
        t,
        trainer,
        env,
        prepare=prepare,
        connect_timeout=min(timedelta(seconds=feed.timeout_s), env.timeout),
        watch=lambda: bool(set(feed.dead()) - rnd.dead),
        restore_rng=restore,
        salvaged=salvaged,
        created=created,
    )


def _restore_rng(rnd: Round, trainer, old_layout: Layout, old_members, holding) -> None:
    """The RNG streams of the lowest source at this rank's (pp, tp) coordinates, if any, from
    the holding it is read from (`holding`: source -> its index)."""
    g = trainer.groups
    for src in sorted(holding):
        if stage_and_tp(old_layout, old_members, src) == (g.pp_rank, g.tp_rank):
            states = rnd.read(f"rng/{src}/{holding[src]}")
            trainer.set_rng_states(torch.load(io.BytesIO(states)))
            return


def rehost(ctx: RecoveryContext, rnd: Round, control: tuple[int, str]) -> None:
    """The lowest survivor serves the control store anew; the others connect to it once it
    says so (PeerGone: another process failed first)."""
    rank, host = control
    feed = ctx.feed
    if dist.get_rank() != rank and not rnd.wait_serving(rank, feed, feed.timeout_s):
        raise PeerGone("another process failed before the control store was hosted anew")
    ctx.rehost(rank, host, feed.timeout_s)
    if dist.get_rank() == rank:
        rnd.serving(rank)


def recover(ctx: RecoveryContext, trainer) -> Recovered:
    """The survivors' recovery on this process (`trainer` None: a standby process): the
    trainer it runs next (None: standby) and the recovery's event (its phases' seconds)."""
    feed = ctx.feed
    t0, wall0 = time.perf_counter(), time.time()
    salvaged = abort(trainer, feed.device_done) if trainer is not None else None
    if salvaged is not None:  # a recovery whose first step has not finished: its holdings too
        salvaged = salvaged.kept_with(ctx.kept)
    t_abort = time.perf_counter()
    created: list = []
    while True:
        rnd, survivors, decision = agree(ctx, salvaged)
        t_agree = time.perf_counter()
        try:
            done = move_and_rebuild(ctx, trainer, salvaged, rnd, decision, created)
            trainer, plan, times = done.trainer, done.plan, done.times
            t_rehost = time.perf_counter()
            if ctx.control_rank in rnd.dead:  # the control store went with its host
                rehost(ctx, rnd, decision.control)
            break
        except RecoveryError:
            raise
        except (RuntimeError, PlanError) as e:  # a process died meanwhile: agree again
            if not more_failures(feed, rnd.dead, feed.timeout_s):
                raise RecoveryError(
                    f"moving to the new layout failed ({e}) and no further failure was "
                    f"recorded within {feed.timeout_s:.0f} s"
                ) from e
        for made in created:  # the new layout's groups: another round builds its own
            if isinstance(made, (ParallelGroups, HeteroGroups)):
                made.destroy()
            else:
                dist.destroy_process_group(made)
        created.clear()
        if trainer is not None:
            trainer.release()
        gc.collect()
    t_done = time.perf_counter()
    lost = [r for r in decision.old_members if r in rnd.dead]  # this failure's
    failed_at = min(feed.dead()[r] for r in lost)
    resumed = decision.iteration
    if plan is None and trainer is not None:  # the snapshot's step
        resumed = trainer.iteration
    event = FailureEvent(
        iteration=resumed,
        old=describe_layout(decision.old_layout),
        new=describe_layout(decision.layout),
        left=",".join(map(str, lost)),
        repeated=max(0, (decision.newest or 0) - (resumed or 0)),
        source="replicas" if plan is not None else "in-memory snapshot",
        detect_s=round(max(0.0, wall0 - failed_at), 4),
        abort_s=round(t_abort - t0, 4),
        agree_s=round(t_agree - t_abort, 4),
        plan_s=round(times.plan_s, 4),
        move_s=round(times.move_s, 4),
        rebuild_s=round(times.rebuild_s + t_done - t_rehost, 4),
        bytes_moved=plan.total_bytes if plan is not None else 0,
        members=decision.members,
        failed_at=failed_at,
    )
    kept = salvaged if trainer is not None else None  # until its first step ends
    return Recovered(trainer, event, survivors, kept)
