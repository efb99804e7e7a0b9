"""The elastic controller: change the layout of a running job at a step boundary.

    RUNNING -> request -> PLAN (new layout and members) -> RESHARD (tensors move between
    processes) -> REBUILD (groups, model chunks, optimizer, loaders) -> RUNNING

Every process of the job runs one `ElasticController`. After each training step the members ask
the leader (the first member) whether to reconfigure; the leader reads drain notices (a process
got SIGTERM: control/drain.py) and then operator requests from the control store (tools/elastic_ctl.py)
and answers for all. Standby processes (started by torchrun but outside the layout) wait on the
next reconfiguration; so do a replacement host's workers (megadyn/launch/rejoin.py), which the
leader takes in (event "rejoin") once all of them are ready, every process first forming a new
default group with them. Layout-free scalars (train state, scheduler, optimizer step) travel in
the reconfiguration's JSON; tensors move with the reshard plan and executor, straight from
process to process, without a disk checkpoint.
"""

from __future__ import annotations

import dataclasses
import time
from functools import cached_property, partial

import torch
import torch.distributed as dist

from megadyn.core.hetero_layout import layout_to_dict
from megadyn.core.layout import Layout
from megadyn.elastic.config import JobConfig
from megadyn.elastic.control.channel import NONE, UNCHANGED, ControlChannel
from megadyn.elastic.control.drain import Drain, DrainSignal, Stopped
from megadyn.elastic.control.events import (
    Event,
    FailureEvent,
    format_event,
    membership_event,
    reconfiguration_event,
)
from megadyn.elastic.control.protocol import ReshardableTrainer
from megadyn.elastic.control.records import (
    Finish,
    Reconfiguration,
    Request,
    RequestError,
    reconfiguration,
)
from megadyn.elastic.control.straggler_action import StragglerAction, resolve_straggler
from megadyn.elastic.planning.hetero_job import replicas_of
from megadyn.elastic.planning.layouts import CostModel
from megadyn.elastic.planning.requests import resolve_drain, resolve_request
from megadyn.elastic.recovery.agreement import FailureFeed, PeerFailed, RecoveryError, poll
from megadyn.elastic.recovery.recovery import RecoveryContext, recover
from megadyn.elastic.recovery.retired_groups import RetiredGroups
from megadyn.elastic.recovery.rng_handover import publish_rng, restore_rng
from megadyn.elastic.reshard.plan import Plan
from megadyn.elastic.transition import (
    Transition,
    TransitionEnv,
    TransitionTimes,
    distopt_of,
    run_transition,
)


class Released(Exception):
    """This process left the layout; it waits as standby, or exits when `leave`."""

    def __init__(self, leave: bool = False):
        super().__init__("left the layout" + (" and the job" if leave else ""))
        self.leave = leave


class ElasticController:
    """One per process: the members' step hook, the standby loop and the reconfiguration."""

    def __init__(
        self,
        cfg: JobConfig,
        channel: ControlChannel | None,
        device,
        *,
        make_trainer=None,
        print_fn=print,
        drain_signal: DrainSignal | None = None,
        failures: FailureFeed | None = None,
        resume=None,
        reconnect=None,
        rejoins=None,
    ):
        """`make_trainer(groups, training: dict, step_hook)` builds the trainer (a
        `ReshardableTrainer`) of a standby process that joins, at the progress in `training`,
        weights uninitialized: they arrive through the reshard; the caller above this package
        provides it (megadyn/launch/run.py), as it provides `drain_signal` (SIGTERM), the
        failure records (`failures`: survivors of a failed process recover in-process,
        recovery/recovery.py), `resume(trainer) -> bool` (load the newest in-memory snapshot, when
        no replica holds what a dead process held) and `reconnect(rank, host, timeout_s)`
        (the control store hosted anew by process `rank` on `host`, when its host died,
        reached within `timeout_s`) and `rejoins` (a replacement host's workers that wait to
        join, and the default group formed anew with them: megadyn/launch/rejoin.py)."""
        self.cfg, self.channel, self.device = cfg, channel, torch.device(device)
        self.make_trainer, self.print = make_trainer, print_fn
        self.drain = Drain(channel, drain_signal)
        self.failures, self.resume = failures, resume or (lambda trainer: False)
        self.reconnect, self.control_rank = reconnect, 0  # rank 0 hosts the control store
        self.control_host: str | None = None  # its host, once a recovery moved it
        self.rejoins = rejoins
        self.epoch = 0
        self.live = list(range(dist.get_world_size()))  # processes that take part in group builds
        self.finished = False  # the job's end was reached (finish, or Finish while standby)
        self.members: list[int] = []  # the layout's, known to standby processes too
        self._recovered: tuple[FailureEvent, float] | None = None  # its first step is still to time
        self.recovered_since_boundary = False  # the leader then looks for a request cut short
        self.kept = None  # what the last recovery read from, until its first step ends
        self.retired = RetiredGroups()  # the last layout's groups, destroyed by a thread
        self.events: list[Event] = []
        self.cost = CostModel()  # the layout planner's, calibrated on measured step times
        self.stragglers = StragglerAction(cfg, print_fn)  # --elastic-straggler-policy

    @cached_property
    def env(self) -> TransitionEnv:
        """What this process's transitions run with."""
        cfg = self.cfg
        return TransitionEnv(
            model_cfg=cfg.model,
            distopt_of=partial(distopt_of, cfg),
            device=self.device,
            round_bytes=cfg.elastic.reshard_chunk_mb * 2**20,
            timeout=cfg.parallel.distributed_timeout,
            make_trainer=lambda groups, training: self.make_trainer(
                groups, training, self.step_hook
            ),
            resume=lambda trainer: self.resume(trainer),
        )

    # --- members: called after every training step ------------------------------------------
    def step_hook(self, trainer: ReshardableTrainer) -> None:
        groups = trainer.groups
        it = trainer.iteration
        self.members = list(groups.grid.members)
        self.retired.start()  # the last layout's groups, once the new layout took a step
        if self._recovered is not None:
            self._log_recovery(trainer)
        self.check_failures()
        self.stragglers.after_step(trainer)  # a straggler action's line, once timed after
        interval = max(1, self.cfg.elastic.control_interval)
        if it % interval:
            return
        self.drain.send(dist.get_rank())  # after SIGTERM: this process's drain notice
        if dist.get_rank() == groups.grid.members[0]:  # the leader
            self.channel.publish_state(
                {
                    "iteration": it,
                    "layout": layout_to_dict(groups.layout),
                    "members": list(groups.grid.members),
                    "live": self.live,
                    "epoch": self.epoch,
                    **replicas_of(groups.layout),
                    **self.stragglers.state(trainer),
                }
            )
            self.channel.decide(it, self._leader_decision(trainer))
        # polled only while failures are watched; otherwise a blocking read of the key
        watching = self.failures is not None
        decision = self.channel.decision(it, self.check_failures if watching else None)
        if decision == NONE:
            self.drain.fall_back_if_refused()
            return
        if "stop" in decision:  # a refused drain under --exit-signal-handler
            raise Stopped(decision["stop"])
        self.apply(self.channel.epoch(decision["epoch"]), trainer)

    def _leader_decision(self, trainer: ReshardableTrainer):
        if self.recovered_since_boundary:  # a request it cut short goes back to the queue
            self.recovered_since_boundary = False
            rid = self.channel.requeue_cut_short()
            if rid is not None:
                self.print(
                    f" elastic: request {rid} was cut short by the failure; it is applied "
                    "again from the queue",
                    flush=True,
                )
        drain = self._drain_decision(trainer)  # drain notices first: a grace period runs
        if drain is not None:
            return drain
        straggler = self._straggler_decision(trainer)  # --elastic-straggler-policy
        if straggler is not None:
            return straggler
        rejoin = self._rejoin_decision(trainer)  # a replacement host's workers are ready
        if rejoin is not None:
            return rejoin
        pending = self.channel.pending_request(self.channel.handled())
        if pending is None:
            return NONE
        rid, text = pending
        try:
            request = Request.from_json(text)
        except RequestError as e:  # a malformed request (written by another tool)
            self.channel.mark_handled(rid)
            return self._refuse(rid, e)
        if trainer.iteration < request.at_iteration:
            return NONE
        self.channel.mark_handled(rid)
        groups = trainer.groups
        try:
            self._calibrate(trainer)
            layout, members, release = resolve_request(
                request, trainer.model_cfg, self.cfg, groups, self.live, cost=self.cost
            )
        except ValueError as e:  # a LayoutError: the layout rules refuse it
            return self._refuse(rid, e)
        rec = reconfiguration(
            trainer, self.epoch + 1, layout, members, release, event=request.action, request=rid
        )
        self.channel.mark_taken(rid)  # until answered: a failure may cut the reconfiguration short
        self.channel.publish_epoch(rec)
        return {"epoch": rec.epoch}

    def _drain_decision(self, trainer: ReshardableTrainer):
        """The oldest drain notice as a reconfiguration (event "drain") or a refusal (stop, or
        "none"); None when no notice waits."""

        def resolve(rank: int, leaving: set[int]):
            self._calibrate(trainer)
            live = [r for r in self.live if r == rank or r not in leaving]
            return resolve_drain(
                rank, trainer.model_cfg, self.cfg, trainer.groups, live, cost=self.cost
            )

        recovers = self.failures is not None  # survivors of a process that ends recover
        return self.drain.decide(
            trainer, self.cfg, resolve, self.epoch + 1, self.print, recovers=recovers
        )

    def _rejoin_decision(self, trainer: ReshardableTrainer):
        """A replacement host's workers, all ready, join: the job's first layout over every
        rank, the newcomers as standby processes of a new default group (event "rejoin");
        None when none wait."""
        offer = None if self.rejoins is None else self.rejoins.offer(self.live)
        if offer is None:
            return None
        rec = reconfiguration(trainer, self.epoch + 1, offer.layout, offer.members, (),
                              event="rejoin")  # fmt: skip
        rec = dataclasses.replace(rec, rejoin=offer.epoch, joining=tuple(offer.ranks))
        self.rejoins.publish(
            offer.epoch,
            {
                "epoch": self.epoch,
                "live": sorted({*self.live, *offer.ranks}),
                "members": list(self.members),
                "control": [self.control_rank, self.control_host],
            },
        )
        self.channel.publish_epoch(rec)
        return {"epoch": rec.epoch}

    def joined(self, info: dict) -> None:
        """A replacement host's worker, in the new default group: the controller's state as
        the survivors' leader published it (rejoin.py); it then waits as standby."""
        self.epoch, self.live, self.members = info["epoch"], list(info["live"]), info["members"]
        self.control_rank, self.control_host = info["control"]

    def _straggler_decision(self, trainer: ReshardableTrainer):
        """The verdict's straggler excluded or its replica given fewer micro batches, as a
        reconfiguration (event "straggler", control/straggler_action.py); None when there is none."""

        def resolve(scores):
            self._calibrate(trainer)
            t = trainer
            return resolve_straggler(scores, t.model_cfg, self.cfg, t.groups, self.live, self.cost)

        return self.stragglers.decide(trainer, self.channel, resolve, self.epoch + 1)

    # --- failures: the survivors stay up (recovery/recovery.py) ----------------------------------------
    def check_failures(self) -> None:
        """Raise PeerFailed when a member of the layout was recorded dead; a dead standby
        process only leaves the live set."""
        dead = self.failures.dead() if self.failures is not None else {}
        gone = [r for r in dead if r in self.live]
        if not gone:
            return
        if any(r in self.members for r in gone):
            raise PeerFailed(f"rank(s) {gone} failed")
        self.live = [r for r in self.live if r not in dead]

    def failed(self, timeout_s: float) -> bool:
        """After a collective raised: whether a member's failure is recorded within
        `timeout_s` (else the error is not a peer's death)."""
        if self.failures is None:
            return False

        def member_failed():
            try:
                self.check_failures()
            except PeerFailed:
                return True
            return None

        return poll(member_failed, timeout_s) is not None

    def recover(self, trainer: ReshardableTrainer | None) -> ReshardableTrainer | None:
        """The survivors' recovery (recovery/recovery.py): the trainer this process runs next, None
        when it waits as standby."""
        self.retired.join(timeout_s=10.0)  # NCCL's abort ends a shutdown that waits on the dead
        ctx = RecoveryContext(
            cfg=self.cfg,
            env=self.env,
            feed=self.failures,
            live=self.live,
            kept=self.kept,
            control_rank=self.control_rank,
            rehost=self.rehost_control,
        )
        self.kept = None
        recovered = recover(ctx, trainer)
        self.kept, self.live = recovered.kept, recovered.live
        self.epoch += 1
        self.recovered_since_boundary = True
        self.members = list(recovered.event.members)
        event = dataclasses.replace(recovered.event, epoch=self.epoch)
        if recovered.trainer is not None:  # its line comes after the first step
            self._recovered = (event, time.perf_counter())
        else:
            self.events.append(event)
        return recovered.trainer

    def rehost_control(self, rank: int, host: str, timeout_s: float) -> None:
        """The control store's host died: process `rank` (on `host`) serves a new one on the
        same port, empty (a request that was queued is lost and has to be sent again); the
        others reach it within `timeout_s` (the recovery's time) or fail."""
        if self.reconnect is None:
            raise RecoveryError("the control store's host died and nothing can host it anew")
        self.channel = self.drain.channel = self.reconnect(rank, host, timeout_s)
        self.control_rank, self.control_host = rank, host
        if dist.get_rank() == rank:
            self.print(f" elastic: rank {rank} ({host}) now hosts the control store", flush=True)

    def _log_recovery(self, trainer: ReshardableTrainer) -> None:
        """After the first step since a recovery: its line (on the last member), with the
        first step's seconds and the total from the failure's record."""
        event, t_done = self._recovered
        self._recovered = self.kept = None
        event = dataclasses.replace(
            event,
            first_step_s=round(time.perf_counter() - t_done, 4),
            total_s=round(time.time() - event.failed_at, 4),
            completed=trainer.iteration,
        )
        self.events.append(event)
        if dist.get_rank() == trainer.groups.grid.members[-1]:
            self.print(format_event(event), flush=True)
            trainer.log_event("reconfiguration", event.to_dict())

    def _calibrate(self, trainer: ReshardableTrainer) -> None:
        """Calibrate the layout planner's cost model on this layout's measured step time."""
        if trainer.step_seconds and isinstance(trainer.groups.layout, Layout):  # a grid's time
            t = self.cfg.training
            self.cost.calibrate(
                trainer.model_cfg,
                t.global_batch_size,
                self.cfg.data.seq_length,
                [(trainer.groups.layout, t.micro_batch_size, t.recompute, trainer.step_seconds)],
            )

    def _refuse(self, rid: int, reason: Exception):
        self.channel.answer(rid, {"status": "refused", "reason": str(reason), "then": UNCHANGED})
        self.print(
            f" elastic: request {rid} refused: {reason}; training continues on the old layout",
            flush=True,
        )
        return NONE

    # --- everyone: one reconfiguration, PLAN -> RESHARD -> REBUILD ---------------------------
    def apply(
        self, rec: Reconfiguration | Finish, trainer: ReshardableTrainer | None
    ) -> ReshardableTrainer | None:
        """Carry out reconfiguration `rec`; returns the trainer this process runs next (or None
        for `Finish`); raises Released when this process leaves the layout."""
        self.epoch, self.kept = rec.epoch, None
        self.retired.join()  # torch's group tables are not for two threads at once
        if isinstance(rec, Finish):
            return None
        self.members = list(rec.members)
        if rec.event == "drain" and (rec.layout, rec.members) == (rec.old_layout, rec.old_members):
            return self._shrink_live_set(rec, trainer)  # a drained standby process leaves

        if rec.rejoin is not None:  # a new default group with a replacement host's workers
            self.rejoins.reform(rec.rejoin)
            if self.failures is not None:
                self.failures.revive(rec.joining)
            self.live = sorted({*self.live, *rec.joining})

        def prepare():
            if trainer is not None:
                trainer.quiesce()  # a snapshot still being written uses the old groups
                if self.channel is not None:  # first: planning may build modules that draw
                    publish_rng(self.channel.store, self.epoch, trainer)

        restore = None
        if self.channel is not None:
            store, epoch = self.channel.store, self.epoch
            restore = lambda t: restore_rng(store, epoch, t, rec.old_layout)  # noqa: E731
        watch = None
        if self.failures is not None:  # a peer that dies meanwhile ends the waits: recovery
            watch = lambda: any(r in self.live for r in self.failures.dead())  # noqa: E731
        done = run_transition(
            Transition.of(rec),
            trainer,
            self.env,
            prepare=prepare,
            watch=watch,
            restore_rng=restore,
            retired=self.retired,
        )
        trainer = done.trainer
        self.live = [r for r in self.live if r not in rec.release]
        self._report(rec, done.plan, done.times, trainer)
        self.stragglers.applied(rec, self.channel)
        if dist.get_rank() in rec.release:
            raise Released(leave=True)  # asked to exit: torchrun keeps the others running
        if trainer is None:
            raise Released()
        return trainer

    def _report(self, rec: Reconfiguration, plan: Plan, times: TransitionTimes, trainer) -> None:
        """The timing event: kept in `events`; the last new member logs it and answers."""
        event = reconfiguration_event(rec, plan, times)
        self.events.append(event)
        if dist.get_rank() == rec.members[-1]:  # one measurement: log line, W&B, answer
            self.print(format_event(event), flush=True)
            trainer.log_event("reconfiguration", event.to_dict())
            if rec.request is not None:
                self.channel.answer(rec.request, {"status": "done", **event.to_dict()})

    def _shrink_live_set(self, rec: Reconfiguration, trainer):
        """Only processes outside the layout leave: nothing moves, no group is built."""
        self.live = [r for r in self.live if r not in rec.release]
        event = membership_event(rec)
        self.events.append(event)
        if dist.get_rank() == rec.members[-1]:
            self.print(format_event(event), flush=True)
            trainer.log_event("reconfiguration", event.to_dict())
        if dist.get_rank() in rec.release or trainer is None:
            raise Released(leave=dist.get_rank() in rec.release)
        return trainer

    # --- standby processes -------------------------------------------------------------------
    def standby(self) -> ReshardableTrainer | None:
        """Wait for the next reconfiguration that includes this process; return its trainer,
        or None when the job finished."""
        rank = dist.get_rank()

        def poll():  # after SIGTERM: the drain notice, and SIGTERM's end if it is refused
            self.drain.send(rank)
            self.drain.fall_back_if_refused()
            self.check_failures()  # a member died: this process may take its place

        while True:
            try:
                rec = self.channel.wait_epoch(self.epoch + 1, on_poll=poll)
            except (PeerFailed, RuntimeError) as e:  # the control store's host may have died
                if not isinstance(e, PeerFailed) and not self.failed(STORE_FAILURE_WAIT_S):
                    raise
                trainer = self.recover(None)
                if trainer is not None:
                    return trainer
                continue
            if isinstance(rec, Finish):
                self.finished = True
                return None
            try:
                trainer = self.apply(rec, None)
            except Released as e:
                if e.leave:
                    return None
                continue
            if trainer is not None and rank in rec.members:
                return trainer

    def finish(self, trainer: ReshardableTrainer | None) -> None:
        """The job is done: refuse the requests still queued (an operator's tool is waiting
        for an answer) and tell standby processes to exit."""
        self.finished = True
        self.retired.join()
        if trainer is None or dist.get_rank() != trainer.groups.grid.members[0]:
            return
        while (pending := self.channel.pending_request(self.channel.handled())) is not None:
            rid, text = pending
            self.channel.mark_handled(rid)
            reason = f"the job finished at iteration {trainer.iteration}"
            try:
                at = Request.from_json(text).at_iteration
            except RequestError as e:
                reason, at = str(e), 0
            if at > trainer.iteration:
                reason += f", before the request's --at-iteration {at}"
            self.channel.answer(rid, {"status": "refused", "reason": reason})
        self.channel.publish_epoch(Finish(self.epoch + 1))
        if self.rejoins is not None:  # a replacement host still waiting to join: it exits
            self.rejoins.close()

    def leave_control(self, timeout_s: float = 30.0) -> None:
        """The job finished: this process is done with the control store. Its host (whose exit
        closes the store) waits until every live process has said so, or `timeout_s`: a
        process still at its last step boundary would otherwise lose the store mid-read."""
        if not self.finished:
            return
        store = self.channel.store
        store.add(FINISHED_KEY, 1)
        if dist.get_rank() != self.control_rank:
            return
        deadline = time.monotonic() + timeout_s
        while store.add(FINISHED_KEY, 0) < len(self.live) and time.monotonic() < deadline:
            time.sleep(0.02)


STORE_FAILURE_WAIT_S = 10.0
"""After the control store failed under a standby process: how long to wait for the agent's
record of a member's death (its host's) before taking the error for another one."""
FINISHED_KEY = "finished/count"
"""Live processes done with the control store at the end of the job (`leave_control`)."""
