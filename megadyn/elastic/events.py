"""The timing event of a reconfiguration, and its log line.

    event = reconfiguration_event(rec, plan, times)    # times: the transition's (transition.py)
    print(format_event(event))   #  elastic: event: drain | epoch: 1 | iteration: 2 | old: ...

The event is what the controller keeps in `events`, reports to W&B, answers the operator's
request with, and prints as one log line (tools/plot_run.py reads it): what asked for it
("layout", "scale", "drain"), the processes that left the job ("left", when some did), the
phases' seconds (plan_s, reshard_s, rebuild_s, total_s) and the plan's bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megadyn.core.hetero_layout import HeteroLayout
from megadyn.core.layout import Layout
from megadyn.elastic.planner import Plan
from megadyn.elastic.records import Reconfiguration

if TYPE_CHECKING:
    from megadyn.elastic.transition import TransitionTimes


def reconfiguration_event(rec: Reconfiguration, plan: Plan, times: TransitionTimes) -> dict:
    """The event of a transition that moved tensors, with its phases' seconds."""
    return {
        **_head(rec),
        "plan_s": round(times.plan_s, 4),
        "reshard_s": round(times.move_s, 4),
        "rebuild_s": round(times.rebuild_s, 4),
        "total_s": round(times.total_s, 4),
        "bytes_moved": plan.total_bytes,
        "bytes_local": plan.local_bytes,
        "max_rank_send_bytes": plan.max_send,
    }


def membership_event(rec: Reconfiguration) -> dict:
    """The event of a change that keeps layout and members (a drained standby process leaves
    the live set): nothing is planned or moved."""
    return {**_head(rec), "total_s": 0.0}


def _head(rec: Reconfiguration) -> dict:
    """What changed: the event, when, the layouts, and the processes that left the job."""
    head = {
        "event": rec.event,
        "epoch": rec.epoch,
        "iteration": rec.iteration,
        "old": describe_layout(rec.old_layout),
        "new": describe_layout(rec.layout),
    }
    if rec.release:
        head["left"] = ",".join(map(str, rec.release))
    return head


def format_event(event: dict) -> str:
    """The log line of a reconfiguration (tools/plot_run.py reads it)."""
    return " elastic: " + " | ".join(f"{k}: {v}" for k, v in event.items())


def describe_layout(layout: Layout | HeteroLayout) -> str:
    """tp2xpp2xdp1, with xcp2, xvpp2, +sp and +2opt (distributed-optimizer instances) when
    they apply; tp1x[pp3+pp2] for replicas of different depth."""
    if isinstance(layout, HeteroLayout):
        return layout.name
    cp = f"xcp{layout.cp}" if layout.cp > 1 else ""
    s = f"tp{layout.tp}{cp}xpp{layout.pp}xdp{layout.dp}"
    if layout.vpp > 1:
        s += f"xvpp{layout.vpp}"
    s += "+sp" if layout.sequence_parallel else ""
    return s + (f"+{layout.distopt_instances}opt" if layout.distopt_instances > 1 else "")
