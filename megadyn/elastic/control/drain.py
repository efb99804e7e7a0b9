"""Draining a process: a preemption notice (SIGTERM) becomes a live scale-in at a step boundary.

    drain = Drain(channel, DrainSignal(received=preemption.received, end=preemption.end))
    drain.send(rank)                      # every step boundary (members) or poll (standby)
    decision = drain.decide(trainer, cfg, resolve, epoch, print)   # the leader, before requests
    drain.fall_back_if_refused()          # after a "none" decision: refused, no save: SIGTERM

The process that got SIGTERM (megadyn/launch/preemption.py sets a flag, nothing more) writes a
drain notice naming its rank into the control store's drain queue at its next step boundary
(a standby process: at its next poll). The leader, whichever process it is, reads the queue
before the operator requests and resolves the notice like a request (planning/requests.py
`resolve_drain`): a standby process takes the drained member's place in the same layout, else
the remaining members go on under the layout for their count. The reconfiguration (event
"drain") releases the drained process, which exits 0; a drained standby process just leaves
the live set.

A drain that cannot run (rank 0, which hosts the control store; fewer members than
--elastic-min-members; no layout for the rest; --elastic-recovery restart) is refused with one
log line. One that the operator asked for (tools/elastic_ctl.py drain) then changes nothing:
the job goes on unchanged. After SIGTERM, Megatron-LM's behaviour follows: with
--exit-signal-handler every member saves a checkpoint (with --save) and the job exits 0;
without it the drained process ends as SIGTERM would have ended it, and the others recover
from its loss as from a failure (in-process recovery) or torchrun stops the job and restarts
it (--max-restarts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megadyn.elastic.config import JobConfig
from megadyn.elastic.control.channel import DRAIN_QUEUE, UNCHANGED, ControlChannel
from megadyn.elastic.control.records import Request, RequestError, reconfiguration


@dataclass(frozen=True)
class DrainSignal:
    """The runtime's side of a preemption notice (megadyn/launch/preemption.py)."""

    received: Callable[[], bool] = lambda: False
    """True once this process got its notice (SIGTERM)."""
    end: Callable[[], None] = lambda: None
    """End this process as SIGTERM's default action would (the drain was refused)."""


class Stopped(Exception):
    """The job stops at this step boundary: every member saves a checkpoint (with --save) and
    exits 0 (--exit-signal-handler, for a SIGTERM that could not be drained)."""


@dataclass
class Refusal:
    """The leader's answer to a drain notice it cannot honour."""

    rank: int | None
    reason: str
    signal: bool = False
    """The notice of a process that got SIGTERM (else the operator's: nothing changes)."""


class Drain:
    """One per process: sends this process's notice; the leader's reading of the queue."""

    QUEUE = DRAIN_QUEUE

    def __init__(self, channel: ControlChannel | None, signal: DrainSignal | None = None):
        self.channel, self.signal = channel, signal or DrainSignal()
        self.notice: int | None = None  # id of the notice this process sent

    # --- the process that got SIGTERM --------------------------------------------------------
    def send(self, rank: int) -> None:
        """Send this process's drain notice once SIGTERM came (once)."""
        if self.notice is None and self.channel is not None and self.signal.received():
            self.notice = self.channel.submit(Request(action="drain", rank=rank))

    def fall_back_if_refused(self) -> None:
        """The leader refused this process's notice and no member saves: end as SIGTERM does
        (the leader logged why)."""
        if self.notice is None:
            return
        answer = self.channel.answered(self.notice, self.QUEUE)
        if answer is not None and answer["status"] == "refused":
            self.signal.end()

    # --- the leader --------------------------------------------------------------------------
    def pending(self) -> tuple[int, Request | Refusal] | None:
        """The oldest drain notice not handled yet (marked handled now), if any: its id and
        the request, or a Refusal when it cannot be read."""
        pending = self.channel.pending_request(self.channel.handled(self.QUEUE), self.QUEUE)
        if pending is None:
            return None
        rid, text = pending
        self.channel.mark_handled(rid, self.QUEUE)
        try:
            return rid, Request.from_json(text)
        except RequestError as e:
            return rid, Refusal(None, str(e))

    def queued_ranks(self) -> set[int]:
        """The ranks of the notices still queued (not to be picked as anyone's replacement)."""
        ranks, first = set(), self.channel.handled(self.QUEUE)
        for rid in range(first, int(self.channel.store.add(f"{self.QUEUE}/next", 0))):
            pending = self.channel.pending_request(rid, self.QUEUE)
            try:
                ranks.add(Request.from_json(pending[1]).rank)
            except (TypeError, RequestError):  # not written yet, or unreadable
                continue
        return ranks

    def decide(
        self, trainer, cfg: JobConfig, resolve: Callable, epoch: int, print_fn, recovers=False
    ):
        """The leader's decision on the oldest notice: {"epoch": n} after publishing the
        drain's reconfiguration `epoch` (`resolve(rank, leaving)`: planning/requests.py resolve_drain,
        where no rank of another queued notice takes anyone's place), or the refusal's
        decision; None when no notice waits. `recovers`: the survivors of a process that
        ends recover in-process (what the refusal's line says SIGTERM then does)."""
        pending = self.pending()
        if pending is None:
            return None
        rid, notice = pending
        leaving = self.queued_ranks()
        if isinstance(notice, Request):
            signal = not notice.by_operator
            if cfg.elastic.recovery != "in-process":
                notice = Refusal(notice.rank, "--elastic-recovery restart", signal)
            else:
                try:
                    layout, members, release = resolve(notice.rank, leaving)
                except ValueError as e:  # a LayoutError: the layout rules refuse it
                    notice = Refusal(notice.rank, str(e), signal)
        if isinstance(notice, Refusal):
            return self.refuse(rid, notice, cfg, trainer.iteration, print_fn, recovers)
        rec = reconfiguration(trainer, epoch, layout, members, release, event="drain")
        self.channel.publish_epoch(rec)
        self.channel.answer(rid, {"status": "accepted", "epoch": epoch}, self.QUEUE)
        return {"epoch": rec.epoch}

    def refuse(
        self, rid: int, refusal: Refusal, cfg: JobConfig, iteration: int, print_fn, recovers: bool
    ) -> dict | str:
        """Answer the notice, log the one line, and return the decision: stop (SIGTERM's
        notice under --exit-signal-handler) or "none" (the operator's drain changes nothing;
        after SIGTERM without --exit-signal-handler the drained process ends itself)."""
        who = "a process" if refusal.rank is None else f"rank {refusal.rank}"
        then = _after_refusal(who, refusal.signal, cfg, iteration, recovers)
        answer = {"status": "refused", "reason": refusal.reason, "then": then}
        self.channel.answer(rid, answer, self.QUEUE)
        print_fn(f" elastic: drain of {who} refused: {refusal.reason}; {then}", flush=True)
        if refusal.signal and cfg.elastic.exit_signal_handler:
            return {"stop": f"drain of {who} refused: {refusal.reason}"}
        return "none"


def _after_refusal(who: str, signal: bool, cfg: JobConfig, iteration: int, recovers: bool) -> str:
    """What the job does once a drain of `who` is refused, as its log line and answer say."""
    if not signal:  # the operator's drain: nothing changes
        return UNCHANGED
    if cfg.elastic.exit_signal_handler:
        if cfg.checkpoint.save:
            return (
                f"--exit-signal-handler: every member saves a checkpoint at iteration "
                f"{iteration} and the job exits"
            )
        return f"--exit-signal-handler: the job exits at iteration {iteration} (no --save)"
    if recovers:
        return (
            f"SIGTERM ends {who} (no --exit-signal-handler), and the others recover from its "
            "loss as from a failure"
        )
    return (
        f"SIGTERM ends {who} (no --exit-signal-handler); torchrun then stops the job's other "
        "workers and restarts them (--max-restarts) or ends the job"
    )
