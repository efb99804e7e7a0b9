"""The leader's decisions: what the whole job does at a step boundary.

    leader = Leader(controller)        # ElasticController.__init__, on every process
    leader.step_boundary(trainer)      # the first member, every --elastic-control-interval
    leader.refuse_queued(trainer)      # the first member, when the job finishes

Every process holds one, since any process may become the first member of a layout (the
leader); only the leader's decides. At a step boundary it publishes the job's state (for
`tools/elastic_ctl.py show`) and then decides for all. A request whose reconfiguration a
failure cut short first goes back to the queue; then the first of these that applies becomes
the next reconfiguration: the oldest drain notice (control/drain.py; drains first, since a grace
period runs), the straggler verdict (control/straggler_action.py), a replacement host's workers
once all are ready (megadyn/launch/rejoin.py), the oldest operator request that is due
(planning/requests.py `resolve_request`). Each resolution first calibrates the layout planner's
cost model on the step time measured under the current layout. The decision ("none",
{"epoch": n} once reconfiguration n is published, or a stop) goes to the control channel,
which every member reads. A request the layout rules refuse is answered with the reason and
one log line, and the job goes on unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from megadyn.core.hetero_layout import layout_to_dict
from megadyn.core.layout import Layout
from megadyn.elastic.control.channel import NONE, UNCHANGED
from megadyn.elastic.control.protocol import ReshardableTrainer
from megadyn.elastic.control.records import Request, RequestError, reconfiguration
from megadyn.elastic.control.straggler_action import resolve_straggler
from megadyn.elastic.planning.hetero_job import replicas_of
from megadyn.elastic.planning.layouts import CostModel
from megadyn.elastic.planning.requests import resolve_drain, resolve_request

if TYPE_CHECKING:
    from megadyn.elastic.control.controller import ElasticController


class Leader:
    """The leader's side of one process's `ElasticController` (module docstring). It reads the
    controller's state at every call instead of holding a copy: a recovery replaces the
    channel (a control store hosted anew) and the live set."""

    def __init__(self, controller: ElasticController):
        self.controller = controller
        self.cost = CostModel()  # the layout planner's, calibrated on measured step times

    def step_boundary(self, trainer: ReshardableTrainer) -> None:
        """Publish the job's state, then this boundary's decision."""
        c, groups = self.controller, trainer.groups
        c.channel.publish_state(
            {
                "iteration": trainer.iteration,
                "layout": layout_to_dict(groups.layout),
                "members": list(groups.grid.members),
                "live": c.live,
                "epoch": c.epoch,
                **replicas_of(groups.layout),
                **c.stragglers.state(trainer),
            }
        )
        c.channel.decide(trainer.iteration, self.decide(trainer))

    def decide(self, trainer: ReshardableTrainer):
        """{"epoch": n} once reconfiguration n is published, a stop (a refused drain under
        --exit-signal-handler), or "none"."""
        self._requeue_cut_short()
        # drain notices first (a grace period runs), then the straggler, then a rejoin
        for decision in (self._drain_decision, self._straggler_decision, self._rejoin_decision):
            decided = decision(trainer)
            if decided is not None:
                return decided
        return self._request_decision(trainer)

    def _requeue_cut_short(self) -> None:
        """After a recovery: the request whose reconfiguration the failure cut short goes back
        to the queue, to be applied again."""
        c = self.controller
        if not c.recovered_since_boundary:
            return
        c.recovered_since_boundary = False
        rid = c.channel.requeue_cut_short()
        if rid is not None:
            c.print(
                f" elastic: request {rid} was cut short by the failure; it is applied "
                "again from the queue",
                flush=True,
            )

    def _drain_decision(self, trainer: ReshardableTrainer):
        """The oldest drain notice as a reconfiguration (event "drain") or a refusal (stop, or
        "none"); None when no notice waits."""
        c = self.controller

        def resolve(rank: int, leaving: set[int]):
            self._calibrate(trainer)
            live = [r for r in c.live if r == rank or r not in leaving]
            return resolve_drain(
                rank, trainer.model_cfg, c.cfg, trainer.groups, live, cost=self.cost
            )

        recovers = c.failures is not None  # survivors of a process that ends recover
        return c.drain.decide(trainer, c.cfg, resolve, c.epoch + 1, c.print, recovers=recovers)

    def _straggler_decision(self, trainer: ReshardableTrainer):
        """The verdict's straggler excluded or its replica given fewer micro batches, as a
        reconfiguration (event "straggler", control/straggler_action.py); None when there is none."""
        c = self.controller

        def resolve(scores):
            self._calibrate(trainer)
            t = trainer
            return resolve_straggler(scores, t.model_cfg, c.cfg, t.groups, c.live, self.cost)

        return c.stragglers.decide(trainer, c.channel, resolve, c.epoch + 1)

    def _rejoin_decision(self, trainer: ReshardableTrainer):
        """A replacement host's workers, all ready, join: the job's first layout over every
        rank, the newcomers as standby processes of a new default group (event "rejoin");
        None when none wait."""
        c = self.controller
        offer = None if c.rejoins is None else c.rejoins.offer(c.live)
        if offer is None:
            return None
        rec = reconfiguration(trainer, c.epoch + 1, offer.layout, offer.members, (),
                              event="rejoin")  # fmt: skip
        rec = dataclasses.replace(rec, rejoin=offer.epoch, joining=tuple(offer.ranks))
        c.rejoins.publish(
            offer.epoch,
            {
                "epoch": c.epoch,
                "live": sorted({*c.live, *offer.ranks}),
                "members": list(c.members),
                "control": [c.control_rank, c.control_host],
            },
        )
        c.channel.publish_epoch(rec)
        return {"epoch": rec.epoch}

    def _request_decision(self, trainer: ReshardableTrainer):
        """The oldest operator request (tools/elastic_ctl.py) as a reconfiguration, once its
        --at-iteration is reached, or refused; "none" when none is due."""
        c = self.controller
        pending = c.channel.pending_request(c.channel.handled())
        if pending is None:
            return NONE
        rid, text = pending
        try:
            request = Request.from_json(text)
        except RequestError as e:  # a malformed request (written by another tool)
            c.channel.mark_handled(rid)
            return self._refuse(rid, e)
        if trainer.iteration < request.at_iteration:
            return NONE
        c.channel.mark_handled(rid)
        try:
            self._calibrate(trainer)
            layout, members, release = resolve_request(
                request, trainer.model_cfg, c.cfg, trainer.groups, c.live, cost=self.cost
            )
        except ValueError as e:  # a LayoutError: the layout rules refuse it
            return self._refuse(rid, e)
        rec = reconfiguration(
            trainer, c.epoch + 1, layout, members, release, event=request.action, request=rid
        )
        c.channel.mark_taken(rid)  # until answered: a failure may cut the reconfiguration short
        c.channel.publish_epoch(rec)
        return {"epoch": rec.epoch}

    def _refuse(self, rid: int, reason: Exception):
        """Answer request `rid` with the reason and say so once; nothing changes."""
        c = self.controller
        c.channel.answer(rid, {"status": "refused", "reason": str(reason), "then": UNCHANGED})
        c.print(
            f" elastic: request {rid} refused: {reason}; training continues on the old layout",
            flush=True,
        )
        return NONE

    def _calibrate(self, trainer: ReshardableTrainer) -> None:
        """Calibrate the layout planner's cost model on this layout's measured step time."""
        if trainer.step_seconds and isinstance(trainer.groups.layout, Layout):  # a grid's time
            t = self.controller.cfg.training
            self.cost.calibrate(
                trainer.model_cfg,
                t.global_batch_size,
                self.controller.cfg.data.seq_length,
                [(trainer.groups.layout, t.micro_batch_size, t.recompute, trainer.step_seconds)],
            )

    def refuse_queued(self, trainer: ReshardableTrainer) -> None:
        """The job finished: refuse the requests still queued (an operator's tool is waiting
        for an answer), naming the iteration, or the request's --at-iteration still ahead."""
        channel = self.controller.channel
        while (pending := channel.pending_request(channel.handled())) is not None:
            rid, text = pending
            channel.mark_handled(rid)
            reason = f"the job finished at iteration {trainer.iteration}"
            try:
                at = Request.from_json(text).at_iteration
            except RequestError as e:
                reason, at = str(e), 0
            if at > trainer.iteration:
                reason += f", before the request's --at-iteration {at}"
            channel.answer(rid, {"status": "refused", "reason": reason})
