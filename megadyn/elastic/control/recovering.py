"""The controller's side of a failure: the survivors stay up and recover in-process.

    recovery = ControllerRecovery(controller)  # ElasticController.__init__, on every process
    recovery.check_failures()                  # members' step boundary, standby's poll
    recovery.failed(timeout_s)                 # after a collective raised: a peer's death?
    trainer = recovery.recover(trainer)        # the survivors (megadyn/launch/run.py, standby)
    recovery.after_step(trainer)               # members, every step: the recovery's line

The failure records (`FailureFeed`, recovery/agreement.py) name the dead processes. A dead
member raises PeerFailed at the next check, and the survivors run the recovery
(recovery/recovery.py) on the controller's live set and what the last recovery read from; a
dead standby process only leaves the live set. When the control store's host died, one
survivor hosts it anew and the others reconnect (`rehost_control`). The recovery's event
(a `FailureEvent`) is logged after the first step under the new layout, with that step's
seconds and the total from the failure's record; a survivor that waits as standby only keeps
it in the controller's events.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from megadyn.elastic.control.events import FailureEvent, format_event
from megadyn.elastic.control.protocol import ReshardableTrainer
from megadyn.elastic.recovery.agreement import PeerFailed, RecoveryError, poll
from megadyn.elastic.recovery.recovery import RecoveryContext, recover

if TYPE_CHECKING:
    from megadyn.elastic.control.controller import ElasticController


class ControllerRecovery:
    """The failure side of one process's `ElasticController` (module docstring). It reads and
    updates the controller's state (live set, members, epoch, channel, the control store's
    host) instead of holding a copy: the leader and the reconfigurations read the same."""

    def __init__(self, controller: ElasticController):
        self.controller = controller
        self.kept = None  # what the last recovery read from, until its first step ends
        self._recovered: tuple[FailureEvent, float] | None = None  # its first step is still to time

    def check_failures(self) -> None:
        """Raise PeerFailed when a member of the layout was recorded dead; a dead standby
        process only leaves the live set."""
        c = self.controller
        dead = c.failures.dead() if c.failures is not None else {}
        gone = [r for r in dead if r in c.live]
        if not gone:
            return
        if any(r in c.members for r in gone):
            raise PeerFailed(f"rank(s) {gone} failed")
        c.live = [r for r in c.live if r not in dead]

    def failed(self, timeout_s: float) -> bool:
        """After a collective raised: whether a member's failure is recorded within
        `timeout_s` (else the error is not a peer's death)."""
        if self.controller.failures is None:
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
        c = self.controller
        c.retired.join(timeout_s=10.0)  # NCCL's abort ends a shutdown that waits on the dead
        ctx = RecoveryContext(
            cfg=c.cfg,
            env=c.env,
            feed=c.failures,
            live=c.live,
            kept=self.kept,
            control_rank=c.control_rank,
            rehost=self.rehost_control,
        )
        self.kept = None
        recovered = recover(ctx, trainer)
        self.kept, c.live = recovered.kept, recovered.live
        c.epoch += 1
        c.recovered_since_boundary = True
        c.members = list(recovered.event.members)
        event = dataclasses.replace(recovered.event, epoch=c.epoch)
        if recovered.trainer is not None:  # its line comes after the first step
            self._recovered = (event, time.perf_counter())
        else:
            c.events.append(event)
        return recovered.trainer

    def rehost_control(self, rank: int, host: str, timeout_s: float) -> None:
        """The control store's host died: process `rank` (on `host`) serves a new one on the
        same port, empty (a request that was queued is lost and has to be sent again); the
        others reach it within `timeout_s` (the recovery's time) or fail."""
        c = self.controller
        if c.reconnect is None:
            raise RecoveryError("the control store's host died and nothing can host it anew")
        c.channel = c.drain.channel = c.reconnect(rank, host, timeout_s)
        c.control_rank, c.control_host = rank, host
        if dist.get_rank() == rank:
            c.print(f" elastic: rank {rank} ({host}) now hosts the control store", flush=True)

    def after_step(self, trainer: ReshardableTrainer) -> None:
        """Every step: after the first one since a recovery, the recovery's line."""
        if self._recovered is not None:
            self._log_recovery(trainer)

    def _log_recovery(self, trainer: ReshardableTrainer) -> None:
        """After the first step since a recovery: its line (on the last member), with the
        first step's seconds and the total from the failure's record."""
        c = self.controller
        event, t_done = self._recovered
        self._recovered = self.kept = None
        event = dataclasses.replace(
            event,
            first_step_s=round(time.perf_counter() - t_done, 4),
            total_s=round(time.time() - event.failed_at, 4),
            completed=trainer.iteration,
        )
        c.events.append(event)
        if dist.get_rank() == trainer.groups.grid.members[-1]:
            c.print(format_event(event), flush=True)
            trainer.log_event("reconfiguration", event.to_dict())
