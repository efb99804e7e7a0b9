"""The elastic controller: change the layout of a running job at a step boundary.

    RUNNING -> request -> PLAN (new layout and members) -> RESHARD (tensors move between
    processes) -> REBUILD (groups, model chunks, optimizer, loaders) -> RUNNING

Every process of the job runs one `ElasticController`. After each training step the members ask
the leader (the first member) whether to reconfigure; the leader (control/leader.py) reads drain
notices (a process got SIGTERM: control/drain.py), the straggler verdict, a replacement host's
readiness and then operator requests from the control store (tools/elastic_ctl.py), and answers
for all. Standby processes (started by torchrun but outside the layout) wait on the
next reconfiguration; so do a replacement host's workers (megadyn/launch/rejoin.py), which the
leader takes in (event "rejoin") once all of them are ready, every process first forming a new
default group with them. Layout-free scalars (train state, scheduler, optimizer step) travel in
the reconfiguration's JSON; tensors move with the reshard plan and executor, straight from
process to process, without a disk checkpoint.
"""

from __future__ import annotations

import time
from functools import cached_property, partial

import torch
import torch.distributed as dist

from megadyn.elastic.config import JobConfig
from megadyn.elastic.control.channel import NONE, ControlChannel
from megadyn.elastic.control.drain import Drain, DrainSignal, Stopped
from megadyn.elastic.control.events import (
    Event,
    format_event,
    membership_event,
    reconfiguration_event,
)
from megadyn.elastic.control.leader import Leader
from megadyn.elastic.control.protocol import ReshardableTrainer
from megadyn.elastic.control.records import Finish, Reconfiguration
from megadyn.elastic.control.recovering import ControllerRecovery
from megadyn.elastic.control.straggler_action import StragglerAction
from megadyn.elastic.recovery.agreement import FailureFeed, PeerFailed
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
        control/recovering.py), `resume(trainer) -> bool` (load the newest in-memory snapshot, when
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
        self.recovered_since_boundary = False  # the leader then looks for a request cut short
        self.retired = RetiredGroups()  # the last layout's groups, destroyed by a thread
        self.events: list[Event] = []
        self.stragglers = StragglerAction(cfg, print_fn)  # --elastic-straggler-policy
        self.leader = Leader(self)  # decides for all while this process is the first member
        self.recovery = ControllerRecovery(self)  # the survivors' side of a failure

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
        self.recovery.after_step(trainer)  # a recovery's line, once its first step is timed
        self.recovery.check_failures()
        self.stragglers.after_step(trainer)  # a straggler action's line, once timed after
        interval = max(1, self.cfg.elastic.control_interval)
        if it % interval:
            return
        self.drain.send(dist.get_rank())  # after SIGTERM: this process's drain notice
        if dist.get_rank() == groups.grid.members[0]:  # the leader
            self.leader.step_boundary(trainer)  # its state, then its decision for all
        # polled only while failures are watched; otherwise a blocking read of the key
        watching = self.failures is not None
        decision = self.channel.decision(it, self.recovery.check_failures if watching else None)
        if decision == NONE:
            self.drain.fall_back_if_refused()
            return
        if "stop" in decision:  # a refused drain under --exit-signal-handler
            raise Stopped(decision["stop"])
        self.apply(self.channel.epoch(decision["epoch"]), trainer)

    # --- failures (control/recovering.py): the names launch/run.py and the tests call --------
    def check_failures(self) -> None:
        self.recovery.check_failures()

    def failed(self, timeout_s: float) -> bool:
        return self.recovery.failed(timeout_s)

    def recover(self, trainer: ReshardableTrainer | None) -> ReshardableTrainer | None:
        return self.recovery.recover(trainer)

    # --- everyone: one reconfiguration, PLAN -> RESHARD -> REBUILD ---------------------------
    def apply(
        self, rec: Reconfiguration | Finish, trainer: ReshardableTrainer | None
    ) -> ReshardableTrainer | None:
        """Carry out reconfiguration `rec`; returns the trainer this process runs next (or None
        for `Finish`); raises Released when this process leaves the layout."""
        self.epoch, self.recovery.kept = rec.epoch, None
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
    def joined(self, info: dict) -> None:
        """A replacement host's worker, in the new default group: the controller's state as
        the survivors' leader published it (rejoin.py); it then waits as standby."""
        self.epoch, self.live, self.members = info["epoch"], list(info["live"]), info["members"]
        self.control_rank, self.control_host = info["control"]

    def standby(self) -> ReshardableTrainer | None:
        """Wait for the next reconfiguration that includes this process; return its trainer,
        or None when the job finished."""
        rank = dist.get_rank()

        def poll():  # after SIGTERM: the drain notice, and SIGTERM's end if it is refused
            self.drain.send(rank)
            self.drain.fall_back_if_refused()
            self.recovery.check_failures()  # a member died: this process may take its place

        while True:
            try:
                rec = self.channel.wait_epoch(self.epoch + 1, on_poll=poll)
            except (PeerFailed, RuntimeError) as e:  # the control store's host may have died
                if not isinstance(e, PeerFailed) and not self.recovery.failed(STORE_FAILURE_WAIT_S):
                    raise
                trainer = self.recovery.recover(None)
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
        self.leader.refuse_queued(trainer)
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
