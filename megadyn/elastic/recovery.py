"""A failed or hung worker as a live reconfiguration: the survivors stay up.

    trainer = recover(controller, trainer, feed)     # after a collective raised or PeerFailed

    detect (the runtime: a collective raised, or the agent's failure record was seen)
    -> ABORT   keep this rank's tensors (views, no communication), drop the model, optimizer and
               every process group of the old layout, so the sockets close and every survivor
               still blocked in a collective with this rank raises too (gloo has no abort)
    -> AGREE   through the agent's store (agreement.py): who is left, the step each survivor's
               tensors are at, and one decision by the lowest surviving member
    -> PLAN    a waiting standby process takes each dead member's place in the same layout;
               else the layout for the survivors' count (requests.layout_for_remaining), keeping
               the global batch; the reshard plan reads only from survivors whose tensors are
               at the agreed step (`restrict`): data-parallel copies, or any other replica the
               state description lists
    -> MOVE    the executor, over a group of the sources and the new members
    -> REBUILD groups, model, optimizer, loaders at the agreed step (the data cursor rolls
               back with it, so no sample is drawn twice), RNG streams of a source
    -> RUNNING at most the interrupted step runs again.

Where no survivor holds a piece (dp 1; the distributed optimizer's shard of the dead rank),
the state comes from the newest in-memory snapshot when the runtime has one (`resume`), else
RecoveryError ends this process and torchrun's restart path follows. A second failure while
one is handled starts the agreement over with the larger set of dead ranks.
"""

from __future__ import annotations

import dataclasses
import gc
import io
import json
import time
from dataclasses import dataclass
from socket import gethostname

import torch
import torch.distributed as dist

from megadyn.core.groups import ParallelGroups
from megadyn.core.hetero_groups import HeteroGroups
from megadyn.core.hetero_layout import layout_from_dict, layout_to_dict
from megadyn.core.layout import Layout, LayoutError
from megadyn.elastic.agreement import FailureFeed, RecoveryError, Report, Round
from megadyn.elastic.description import StateDescription
from megadyn.elastic.events import describe_layout
from megadyn.elastic.executor import execute_plan
from megadyn.elastic.hetero_job import (
    build_groups,
    describe_layout_state,
    layout_for_members,
    stage_and_tp,
    with_ranks_replaced,
)
from megadyn.elastic.planner import PlanError, plan_between


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
    model_cfg: object


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


def restrict(desc: StateDescription, holders) -> StateDescription:
    """`desc` with only the pieces that `holders` hold: the replicas a recovery may read."""
    keep = set(holders)
    return StateDescription(desc.tensors, {r: p for r, p in desc.pieces.items() if r in keep})


def recovery_plan(model_cfg, distopt_of, old_layout, old_members, layout, members, sources):
    """The reshard plan that rebuilds `layout` over `members` from `sources` alone (PlanError
    when some piece has no holder among them)."""
    old = describe_layout_state(model_cfg, old_layout, old_members, distopt_of(old_layout))
    new = describe_layout_state(model_cfg, layout, members, distopt_of(layout))
    return plan_between(restrict(old, sources), new)


def decide(controller, model_cfg, groups, reports: dict[int, Report], dead: set[int]) -> dict:
    """The lowest surviving member's decision: the new layout and members, the step and the
    sources, or why the survivors cannot go on."""
    cfg = controller.cfg
    members = {r: rep for r, rep in reports.items() if rep.member}
    views = {(json_key(rep.layout), tuple(rep.members)) for rep in members.values()}
    if len(views) != 1:
        return {"error": f"the survivors disagree on the layout they trained under: {views}"}
    old_layout = layout_from_dict(next(iter(members.values())).layout)
    old_members = groups.grid.members
    lost = [r for r in old_members if r in dead]
    standby = [r for r in sorted(reports) if r not in old_members]
    try:
        if len(standby) >= len(lost):  # standby processes take the dead members' places
            fill = dict(zip(lost, standby))
            layout, new_members = with_ranks_replaced(old_layout, old_members, fill)
        else:  # every survivor, standby processes too, under the layout for their count
            rest = sorted([r for r in old_members if r not in dead] + standby)
            layout, new_members = layout_for_members(rest, model_cfg, cfg, groups)
    except LayoutError as e:
        return {"error": f"no layout for the survivors: {e}"}
    head = {
        "layout": layout_to_dict(layout),
        "members": new_members,
        "old_layout": layout_to_dict(old_layout),
        "old_members": list(old_members),
        "group_count": max(rep.group_count for rep in reports.values()),
        "vocab_size": model_cfg.vocab_size,
        "control": [min(reports), reports[min(reports)].host],  # if its host died
    }
    steps = sorted({rep.iteration for rep in members.values() if rep.iteration is not None})
    head["newest"] = max(steps, default=None)
    reason = "no survivor finished a step cleanly"
    for it in steps:  # the oldest step first: every survivor went that far
        sources = sorted(r for r, rep in members.items() if rep.iteration == it)
        try:
            recovery_plan(
                model_cfg,
                controller.distopt_of,
                old_layout,
                old_members,
                layout,
                new_members,
                sources,
            )
        except PlanError as e:
            reason = f"no survivor holds a replica ({e})"
            continue
        return {**head, "iteration": it, "sources": sources, "training": members[it_source(
            members, it)].training}  # fmt: skip
    newest = head["newest"]
    training = members[it_source(members, newest)].training if newest is not None else None
    return {**head, "iteration": newest, "sources": [], "training": training, "missing": reason}


def json_key(d: dict) -> str:
    return json.dumps(d, sort_keys=True)


def it_source(members: dict[int, Report], it: int) -> int:
    return min(r for r, rep in members.items() if rep.iteration == it)


def group_count_at_least(n: int) -> None:
    """Every survivor draws the next process-group names from the same count (a failure may
    have cut a round of group creation short on some of them)."""
    world = dist.distributed_c10d._world
    world.group_count = max(world.group_count, n)


def agree(controller, salvaged: Salvaged | None, feed: FailureFeed) -> tuple[Round, list, dict]:
    """AGREE: report, wait for every survivor's report and the decision; start over when more
    failures are recorded meanwhile."""
    rank = dist.get_rank()
    while True:
        dead = set(feed.dead())
        survivors = [r for r in controller.live if r not in dead]
        rnd = Round(feed.store, dead)
        report = Report(
            rank, member=salvaged is not None, group_count=_group_count(), host=gethostname()
        )
        if salvaged is not None:
            g = salvaged.groups
            report = dataclasses.replace(
                report,
                iteration=salvaged.iteration,
                training=salvaged.training,
                layout=layout_to_dict(g.layout),
                members=list(g.grid.members),
            )
            rnd.publish(f"rng/{rank}", salvaged.rng)
        rnd.report(report)
        reports = rnd.wait_reports(survivors, feed, feed.timeout_s)
        if reports is None:
            continue
        deciders = [r for r, rep in reports.items() if rep.member]
        if not deciders:
            raise RecoveryError("no member of the layout survived")
        if rank == min(deciders):
            rnd.decide(decide(controller, salvaged.model_cfg, salvaged.groups, reports, dead))
        decision = rnd.wait_decision(feed, feed.timeout_s)
        if decision is None:
            continue
        if "error" in decision:
            raise RecoveryError(decision["error"])
        return rnd, survivors, decision


def _group_count() -> int:
    return dist.distributed_c10d._world.group_count


def move_and_rebuild(controller, trainer, salvaged, rnd: Round, decision: dict, created: list):
    """PLAN, MOVE and REBUILD by `decision`; returns this process's trainer (None: standby)
    and the plan. Groups it creates go into `created` (dropped if another failure cuts it
    short)."""
    rank, cfg = dist.get_rank(), controller.cfg
    timeout = cfg.parallel.distributed_timeout
    layout, members = layout_from_dict(decision["layout"]), list(decision["members"])
    old_layout, old_members = layout_from_dict(decision["old_layout"]), decision["old_members"]
    sources = decision["sources"]
    group_count_at_least(decision["group_count"])
    span = sorted(set(sources) | set(members))
    span_group = dist.new_group(span, timeout=timeout)  # every survivor, in one order
    created.append(span_group)
    groups = build_groups(layout, members, timeout=timeout)
    created.append(groups)
    model_cfg = cfg.model.with_(vocab_size=decision["vocab_size"])
    plan = None
    if sources:
        plan = recovery_plan(
            model_cfg, controller.distopt_of, old_layout, old_members, layout, members, sources
        )
    t_move = time.perf_counter()
    new_state = {}
    if plan is not None and rank in span:
        local = salvaged.tensors if salvaged is not None else {}
        new_state = execute_plan(
            plan,
            local.__getitem__,
            group=span_group,
            device=controller.device,
            round_bytes=cfg.elastic.reshard_chunk_mb * 2**20,
        )
    t_rebuild = time.perf_counter()
    training = decision["training"]
    if rank not in members:
        if trainer is not None:
            trainer.release()
        trainer = None
    elif trainer is None:  # a standby process takes a dead member's place
        trainer = controller.make_trainer(groups, training, controller.step_hook)
    else:
        trainer.rebuild(groups, training)
    if trainer is not None:
        if plan is not None:
            trainer.take(new_state, training)
            _restore_rng(rnd, trainer, old_layout, old_members, sources)
        elif not controller.resume(trainer):
            raise RecoveryError(f"{decision['missing']}, and no in-memory snapshot to load")
    dist.destroy_process_group(span_group)
    created.remove(span_group)
    return trainer, plan, (t_move, t_rebuild)


def _restore_rng(rnd: Round, trainer, old_layout: Layout, old_members, sources) -> None:
    """The RNG streams of the lowest source at this rank's (pp, tp) coordinates, if any."""
    g = trainer.groups
    for src in sources:
        if stage_and_tp(old_layout, old_members, src) == (g.pp_rank, g.tp_rank):
            trainer.set_rng_states(torch.load(io.BytesIO(rnd.read(f"rng/{src}"))))
            return


def recover(controller, trainer, feed: FailureFeed) -> tuple[object, dict]:
    """The survivors' recovery on this process (`trainer` None: a standby process): the
    trainer it runs next (None: standby) and the recovery's event (its phases' seconds)."""
    t0, wall0 = time.perf_counter(), time.time()
    salvaged = abort(trainer, feed.device_done) if trainer is not None else None
    t_abort = time.perf_counter()
    created: list = []
    while True:
        rnd, survivors, decision = agree(controller, salvaged, feed)
        t_agree = time.perf_counter()
        try:
            trainer, plan, (t_move, t_rebuild) = move_and_rebuild(
                controller, trainer, salvaged, rnd, decision, created
            )
            break
        except RecoveryError:
            raise
        except (RuntimeError, PlanError):  # a collective with a process that died meanwhile
            if not _more_failures(feed, rnd.dead, feed.timeout_s):
                raise
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
    controller.live = survivors
    if controller.control_rank in rnd.dead:  # the control store went with its host
        controller.rehost_control(*decision["control"])
    lost = [r for r in decision["old_members"] if r in rnd.dead]  # this failure's
    failed_at = min(feed.dead()[r] for r in lost)
    resumed = decision["iteration"]
    if plan is None and trainer is not None:  # the snapshot's step
        resumed = trainer.iteration
    event = {
        "event": "failure",
        "iteration": resumed,
        "old": describe_layout(layout_from_dict(decision["old_layout"])),
        "new": describe_layout(layout_from_dict(decision["layout"])),
        "left": ",".join(map(str, lost)),
        "repeated": max(0, (decision["newest"] or 0) - (resumed or 0)),
        "from": "replicas" if plan is not None else "in-memory snapshot",
        "detect_s": round(max(0.0, wall0 - failed_at), 4),
        "abort_s": round(t_abort - t0, 4),
        "agree_s": round(t_agree - t_abort, 4),
        "plan_s": round(t_move - t_agree, 4),
        "move_s": round(t_rebuild - t_move, 4),
        "rebuild_s": round(t_done - t_rebuild, 4),
        "bytes_moved": plan.total_bytes if plan is not None else 0,
        "members": decision["members"],
        "failed_at": failed_at,
    }
    return trainer, event


def _more_failures(feed: FailureFeed, seen: set[int], timeout_s: float) -> bool:
    """Whether a failure beyond `seen` gets recorded within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if set(feed.dead()) - seen:
            return True
        time.sleep(0.02)
    return False
