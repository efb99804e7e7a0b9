"""The events of the elastic spine (a reconfiguration, a failure's recovery) and their log line.

    event = reconfiguration_event(rec, plan, times)    # times: the transition's (transition.py)
    print(format_event(event))   #  elastic: event: drain | epoch: 1 | iteration: 2 | old: ...
    event.to_dict()              # the JSON of W&B, the metrics log and the operator's answer

The event is what the controller keeps in `events`, reports to W&B, answers the operator's
request with, and prints as one log line (tools/plot_run.py reads it): what asked for it
("layout", "scale", "drain", "failure"), the processes that left the job ("left", when some
did), the phases' seconds and the plan's bytes. `to_dict` keeps the fields in their declared
order and leaves out the optional ones not set; fields marked internal stay out of it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megadyn.core.hetero_layout import HeteroLayout
from megadyn.core.layout import Layout
from megadyn.elastic.control.records import Reconfiguration
from megadyn.elastic.reshard.plan import Plan

if TYPE_CHECKING:
    from megadyn.elastic.transition import TransitionTimes

INTERNAL = {"internal": True}
"""Field metadata: kept on the event, left out of its dict and log line."""


def _to_dict(event) -> dict:
    """The fields in declared order under their keys, without unset optional ones."""
    out = {}
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        if f.metadata.get("internal") or (value is None and f.metadata.get("optional")):
            continue
        out[f.metadata.get("key", f.name)] = value
    return out


def _optional():
    return field(default=None, metadata={"optional": True})


@dataclass(frozen=True, kw_only=True)
class ReconfigurationEvent:
    """A reconfiguration of the running layout: what changed and its phases' seconds (only the
    total, 0, when nothing moved: a drained standby process left the live set)."""

    event: str
    """What asked for it: "layout", "scale" or "drain"."""
    epoch: int
    iteration: int
    """The iteration after which the layout changed."""
    old: str
    new: str
    left: str | None = _optional()
    """The processes that left the job, comma-separated."""
    plan_s: float | None = _optional()
    reshard_s: float | None = _optional()
    rebuild_s: float | None = _optional()
    total_s: float = 0.0
    bytes_moved: int | None = _optional()
    bytes_local: int | None = _optional()
    max_rank_send_bytes: int | None = _optional()

    def to_dict(self) -> dict:
        return _to_dict(self)


@dataclass(frozen=True, kw_only=True)
class FailureEvent:
    """A failure's in-process recovery: the layouts, where the state came from and the phases'
    seconds; the first step's and the total's once the new layout's first step ended."""

    epoch: int = 0
    event: str = "failure"
    iteration: int | None
    """The step the survivors went on from."""
    old: str
    new: str
    left: str
    """The members lost, comma-separated."""
    repeated: int
    """Steps trained again (the newest step a survivor reached, less the one gone on from)."""
    source: str = field(metadata={"key": "from"})
    """"replicas" or "in-memory snapshot"."""
    detect_s: float
    abort_s: float
    agree_s: float
    plan_s: float
    move_s: float
    rebuild_s: float
    bytes_moved: int
    first_step_s: float | None = _optional()
    total_s: float | None = _optional()
    """From the failure's record to the end of the first step."""
    completed: int | None = _optional()
    """The iteration the first step completed."""
    members: tuple[int, ...] = field(default=(), metadata=INTERNAL)
    """The new layout's members."""
    failed_at: float = field(default=0.0, metadata=INTERNAL)
    """Wall time the failure was recorded."""

    def to_dict(self) -> dict:
        return _to_dict(self)


Event = ReconfigurationEvent | FailureEvent


def reconfiguration_event(
    rec: Reconfiguration, plan: Plan, times: TransitionTimes
) -> ReconfigurationEvent:
    """The event of a transition that moved tensors, with its phases' seconds."""
    return ReconfigurationEvent(
        **_head(rec),
        plan_s=round(times.plan_s, 4),
        reshard_s=round(times.move_s, 4),
        rebuild_s=round(times.rebuild_s, 4),
        total_s=round(times.total_s, 4),
        bytes_moved=plan.total_bytes,
        bytes_local=plan.local_bytes,
        max_rank_send_bytes=plan.max_send,
    )


def membership_event(rec: Reconfiguration) -> ReconfigurationEvent:
    """The event of a change that keeps layout and members (a drained standby process leaves
    the live set): nothing is planned or moved."""
    return ReconfigurationEvent(**_head(rec), total_s=0.0)


def _head(rec: Reconfiguration) -> dict:
    """What changed: the event, when, the layouts, and the processes that left the job."""
    left = ",".join(map(str, rec.release)) if rec.release else None
    return {
        "event": rec.event,
        "epoch": rec.epoch,
        "iteration": rec.iteration,
        "old": describe_layout(rec.old_layout),
        "new": describe_layout(rec.layout),
        "left": left,
    }


def format_event(event: Event | dict) -> str:
    """The log line of an event, or of a straggler action's fields (tools/plot_run.py reads
    them)."""
    fields = event if isinstance(event, dict) else event.to_dict()
    return " elastic: " + " | ".join(f"{k}: {v}" for k, v in fields.items())


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
