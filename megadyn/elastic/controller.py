"""The elastic controller: change the layout of a running job at a step boundary.

    RUNNING -> request -> PLAN (new layout and members) -> RESHARD (tensors move between
    processes) -> REBUILD (groups, model chunks, optimizer, loaders) -> RUNNING

Every process of the job runs one `ElasticController`. After each training step the members ask
the leader (the first member) whether to reconfigure; the leader reads operator requests from
the control store (tools/elastic_ctl.py) and answers for all. Standby processes (started by
torchrun but outside the layout) wait on the next reconfiguration. Layout-free scalars (train
state, scheduler, optimizer step) travel in the reconfiguration's JSON; tensors move with the
reshard plan and executor, straight from process to process, without a disk checkpoint.
"""

from __future__ import annotations

import dataclasses
import io
import time

import torch
import torch.distributed as dist

from megadyn.core.distributed import default_bucket_size
from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout, LayoutError
from megadyn.elastic.control import NONE, ControlChannel
from megadyn.elastic.description import DistOpt
from megadyn.elastic.executor import execute_plan
from megadyn.elastic.layout_planner import CostModel
from megadyn.elastic.planner import plan_reshard
from megadyn.elastic.protocol import ReshardableTrainer
from megadyn.elastic.requests import resolve_request


class Released(Exception):
    """This process left the layout; it waits as standby, or exits when `leave`."""

    def __init__(self, leave: bool = False):
        super().__init__("left the layout" + (" and the job" if leave else ""))
        self.leave = leave


def reconfiguration(
    trainer: ReshardableTrainer,
    epoch: int,
    layout: Layout,
    members,
    release,
    *,
    event: str = "layout",
    request: int | None = None,
) -> dict:
    """The JSON every process acts on: new layout and members, and the layout-free scalars."""
    return {
        "epoch": epoch,
        "request": request,
        "event": event,
        "layout": dataclasses.asdict(layout),
        "members": list(members),
        "release": list(release),
        "old_layout": dataclasses.asdict(trainer.groups.layout),
        "old_members": list(trainer.groups.grid.members),
        "training": trainer.training_state_dict(),
        "vocab_size": trainer.model_cfg.vocab_size,
    }


class ElasticController:
    def __init__(
        self,
        cfg,
        channel: ControlChannel | None,
        device,
        *,
        make_trainer=None,
        print_fn=print,
    ):
        """`make_trainer(groups, training: dict, step_hook)` builds the trainer (a
        `ReshardableTrainer`) of a standby process that joins, at the progress in `training`,
        weights uninitialized: they arrive through the reshard; the caller above this package
        provides it (megadyn/launch/run.py)."""
        self.cfg, self.channel, self.device = cfg, channel, torch.device(device)
        self.make_trainer, self.print = make_trainer, print_fn
        self.epoch = 0
        self.live = list(range(dist.get_world_size()))  # processes that take part in group builds
        self.events: list[dict] = []
        self.cost = CostModel()  # the layout planner's, calibrated on measured step times

    # --- members: called after every training step ------------------------------------------
    def step_hook(self, trainer: ReshardableTrainer) -> None:
        groups = trainer.groups
        it = trainer.iteration
        interval = max(1, self.cfg.elastic.control_interval)
        if it % interval:
            return
        leader = groups.grid.members[0]
        if dist.get_rank() == leader:
            self.channel.publish_state(
                {
                    "iteration": it,
                    "layout": dataclasses.asdict(groups.layout),
                    "members": list(groups.grid.members),
                    "live": self.live,
                    "epoch": self.epoch,
                }
            )
            self.channel.decide(it, self._leader_decision(trainer))
        decision = self.channel.decision(it)
        if decision == NONE:
            return
        self.apply(self.channel.epoch(decision["epoch"]), trainer)

    def _leader_decision(self, trainer: ReshardableTrainer):
        pending = self.channel.pending_request(self.channel.handled())
        if pending is None:
            return NONE
        rid, request = pending
        if trainer.iteration < request.get("at_iteration", 0):
            return NONE
        self.channel.mark_handled(rid)
        groups = trainer.groups
        try:
            if trainer.step_seconds:  # calibrate the cost model on this layout's step time
                t = self.cfg.training
                self.cost.calibrate(
                    trainer.model_cfg,
                    t.global_batch_size,
                    self.cfg.data.seq_length,
                    [(groups.layout, t.micro_batch_size, t.recompute, trainer.step_seconds)],
                )
            layout, members, release = resolve_request(
                request, trainer.model_cfg, self.cfg, groups, self.live, cost=self.cost
            )
        except (LayoutError, ValueError, TypeError, KeyError, ZeroDivisionError) as e:
            # a request the layout rules refuse, or a malformed one (written by another tool)
            self.channel.answer(rid, {"status": "refused", "reason": str(e)})
            self.print(
                f" elastic: request {rid} refused: {e}; training continues on the old layout",
                flush=True,
            )
            return NONE
        rec = reconfiguration(
            trainer,
            self.epoch + 1,
            layout,
            members,
            release,
            event=request.get("action", "layout"),
            request=rid,
        )
        self.channel.publish_epoch(rec["epoch"], rec)
        return {"epoch": rec["epoch"]}

    # --- everyone: one reconfiguration ---------------------------------------------------------
    def apply(self, rec: dict, trainer):
        """Carry out reconfiguration `rec`; returns the trainer this process runs next (or None)."""
        rank = dist.get_rank()
        self.epoch = rec["epoch"]
        if rec.get("event") == "finish":
            return None
        t0 = time.perf_counter()
        if trainer is not None:
            trainer.quiesce()  # a snapshot still being written uses the old groups
            self._publish_rng(trainer)  # first: planning may build modules that draw random numbers
        old_layout, new_layout = Layout(**rec["old_layout"]), Layout(**rec["layout"])
        old_members, new_members = rec["old_members"], rec["members"]
        span = sorted(set(old_members) | set(new_members))
        # the reshard runs over the world group when every process of the job takes part (its
        # NCCL communicator exists already); else over a group of the old and new members,
        # which every live process creates (see groups.py): processes outside the span (standby
        # processes sitting the change out) never enter the reshard's collectives
        whole_world = span == list(range(dist.get_world_size()))
        timeout = self.cfg.parallel.distributed_timeout
        span_group = None if whole_world else dist.new_group(span, timeout=timeout)
        new_groups = ParallelGroups.build(new_layout, new_members, timeout=timeout)
        model_cfg = self.cfg.model.with_(vocab_size=rec["vocab_size"])
        plan = plan_reshard(
            model_cfg,
            old_layout,
            old_members,
            new_layout,
            new_members,
            old_distopt=distopt_of(self.cfg, old_layout),
            new_distopt=distopt_of(self.cfg, new_layout),
        )
        t_plan = time.perf_counter()
        new_state = {}
        if rank in span:
            local = trainer.export_state() if trainer is not None else {}
            chunk_bytes = self.cfg.elastic.reshard_chunk_mb * 2**20
            new_state = execute_plan(
                plan,
                local.__getitem__,
                group=span_group,
                device=self.device,
                round_bytes=chunk_bytes,
            )
            del local
        t_reshard = time.perf_counter()
        if trainer is not None:
            old_groups = trainer.groups
            if rank not in new_members:
                trainer.release()
            old_groups.destroy()
        if rank in new_members:
            trainer = self._rebuild(trainer, new_groups, new_state, rec)
        else:
            trainer = None
        if span_group is not None:
            dist.destroy_process_group(span_group)
        self.live = [r for r in self.live if r not in rec["release"]]
        t_done = time.perf_counter()
        event = {
            "event": rec["event"],
            "epoch": self.epoch,
            "iteration": rec["training"]["state"]["iteration"],
            "old": _describe(old_layout),
            "new": _describe(new_layout),
            "plan_s": round(t_plan - t0, 4),
            "reshard_s": round(t_reshard - t_plan, 4),
            "rebuild_s": round(t_done - t_reshard, 4),
            "total_s": round(t_done - t0, 4),
            "bytes_moved": plan.total_bytes,
            "bytes_local": plan.local_bytes,
            "max_rank_send_bytes": plan.max_send,
        }
        self.events.append(event)
        if rank == new_members[-1]:  # one measurement: the log line, W&B and the answer
            self.print(format_event(event), flush=True)
            trainer.log_event("reconfiguration", event)
            if rec.get("request") is not None:
                self.channel.answer(rec["request"], {"status": "done", **event})
        if rank in rec["release"]:
            raise Released(leave=True)  # asked to exit: torchrun keeps the others running
        if trainer is None:
            raise Released()
        return trainer

    def _rebuild(self, trainer, groups, new_state, rec) -> ReshardableTrainer:
        if trainer is None:  # a standby process joins
            trainer = self.make_trainer(groups, rec["training"], self.step_hook)
        else:
            trainer.rebuild(groups, rec["training"])
        trainer.take(new_state, rec["training"])
        self._restore_rng(trainer, Layout(**rec["old_layout"]))
        return trainer

    # --- RNG streams: the default stream depends on the pipeline rank, the tracker's on the
    # tensor and pipeline rank; a new rank takes the streams of the old rank with its (pp, tp)
    # coordinates, and keeps freshly seeded ones when the old layout had no such rank
    def _rng_key(self, pp_rank: int, tp_rank: int) -> str:
        return f"rng/{self.epoch}/pp{pp_rank}/tp{tp_rank}"

    def _publish_rng(self, trainer) -> None:
        g = trainer.groups
        if self.channel is None or g.dp_rank != 0:
            return
        buf = io.BytesIO()
        torch.save(trainer.rng_states(), buf)
        self.channel.store.set(self._rng_key(g.pp_rank, g.tp_rank), buf.getvalue())

    def _restore_rng(self, trainer, old_layout: Layout) -> None:
        g = trainer.groups
        if self.channel is None or g.pp_rank >= old_layout.pp or g.tp_rank >= old_layout.tp:
            return
        states = torch.load(io.BytesIO(self.channel.store.get(self._rng_key(g.pp_rank, g.tp_rank))))
        trainer.set_rng_states(states)

    # --- standby processes -------------------------------------------------------------------
    def standby(self):
        """Wait for the next reconfiguration that includes this process; return its trainer,
        or None when the job finished."""
        rank = dist.get_rank()
        while True:
            rec = self.channel.wait_epoch(self.epoch + 1)
            if rec.get("event") == "finish":
                return None
            try:
                trainer = self.apply(rec, None)
            except Released as e:
                if e.leave:
                    return None
                continue
            if trainer is not None and rank in rec["members"]:
                return trainer

    def finish(self, trainer) -> None:
        """The job is done: refuse the requests still queued (an operator's tool is waiting
        for an answer) and tell standby processes to exit."""
        if trainer is None or dist.get_rank() != trainer.groups.grid.members[0]:
            return
        while (pending := self.channel.pending_request(self.channel.handled())) is not None:
            rid, request = pending
            self.channel.mark_handled(rid)
            reason = f"the job finished at iteration {trainer.iteration}"
            if request.get("at_iteration", 0) > trainer.iteration:
                reason += f", before the request's --at-iteration {request['at_iteration']}"
            self.channel.answer(rid, {"status": "refused", "reason": reason})
        self.channel.publish_epoch(self.epoch + 1, {"epoch": self.epoch + 1, "event": "finish"})


def format_event(event: dict) -> str:
    """The log line of a reconfiguration (tools/plot_run.py reads it)."""
    return " elastic: " + " | ".join(f"{k}: {v}" for k, v in event.items())


def distopt_of(cfg, layout: Layout):
    if not cfg.optimizer.use_distributed_optimizer:
        return None
    return DistOpt(bucket_size=default_bucket_size(cfg.parallel.overlap_grad_reduce, layout.dp))


def _describe(layout: Layout) -> str:
    s = f"tp{layout.tp}xpp{layout.pp}xdp{layout.dp}"
    if layout.vpp > 1:
        s += f"xvpp{layout.vpp}"
    return s + ("+sp" if layout.sequence_parallel else "")
