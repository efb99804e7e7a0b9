"""The records that travel through the control store, as types with a JSON form.

    request = Request(action="layout", tp=1, pp=2, at_iteration=20)   # tools/elastic_ctl.py
    channel.submit(request)                                 # stores request.to_json()
    channel.submit(Request(action="drain", rank=2))         # rank 2 got SIGTERM (control/drain.py)
    Request.from_json(text)                                 # the leader; RequestError: refused

    rec = Reconfiguration(epoch=1, event="layout", layout=..., members=(0, 1), ...)
    channel.publish_epoch(rec)                              # every process acts on it
    epoch_record(text)                                      # Reconfiguration or Finish

A request is checked when it is made and again when the leader reads it (another tool may have
written the store), so a malformed one is refused with a reason naming the field; whether its
layout can run this job is the leader's question (megadyn/elastic/planning/requests.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megadyn.core.hetero_layout import HeteroLayout, layout_from_dict, layout_to_dict
from megadyn.core.layout import Layout

if TYPE_CHECKING:
    from megadyn.elastic.control.protocol import ReshardableTrainer

ACTIONS = ("layout", "scale", "drain")


class RequestError(ValueError):
    """A request the job cannot read; the message names the field."""


def _read_object(text: str, what: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"{what} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise RequestError(f"{what} must be a JSON object, got {value!r}")
    return value


@dataclass(frozen=True)
class Request:
    """An operator request: a new layout, or a new number of processes; or a drain notice.

    "layout" takes tp, pp, cp (None: as now), vpp, sp and members or dp (None: as many as now);
    "scale" takes members and leaves the layout to --elastic-layout; "drain" takes the rank
    that leaves the job (a preemption notice: megadyn/elastic/control/drain.py).
    """

    action: str = "layout"
    """"layout" (the degrees given here) or "scale" (a process count)."""
    tp: int | None = None
    """Tensor-parallel size of the new layout (None: the current one)."""
    pp: int | None = None
    """Pipeline-parallel size of the new layout (None: the current one)."""
    cp: int | None = None
    """Context-parallel size of the new layout (None: the current one)."""
    vpp: int = 1
    """Virtual pipeline stages per pipeline rank."""
    sp: bool = False
    """Sequence parallelism in the new layout."""
    members: int | None = None
    """Processes to use (a scale needs it; None for a layout: as many as now)."""
    dp: int | None = None
    """Data-parallel size of the new layout (instead of members: tp * cp * pp * dp processes)."""
    release: bool = False
    """Processes left out exit instead of waiting as standby."""
    at_iteration: int = 0
    """Applied at the first step boundary at or after this iteration."""
    rank: int | None = None
    """The process that leaves the job (a drain; it exits 0)."""
    by_operator: bool = False
    """A drain that tools/elastic_ctl.py asked for (refused, it changes nothing); False for the
    notice of a process that got SIGTERM (control/drain.py)."""
    pipelines: tuple[int, ...] | None = None
    """Stages of each replica of a heterogeneous layout (--heterogeneous-pipelines), e.g.
    (3, 2); tp as given or as now; members follow."""

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise RequestError(
                f"unknown request action {self.action!r} (use 'layout', 'scale' or 'drain')"
            )
        for name in ("tp", "pp", "cp", "vpp", "members", "dp"):
            value = getattr(self, name)
            optional = value is None and name != "vpp"  # None: as now
            if not optional and (type(value) is not int or value < 1):
                raise RequestError(f"{name} must be a positive integer, got {value!r}")
        if type(self.at_iteration) is not int or self.at_iteration < 0:
            raise RequestError(f"at_iteration must be an integer >= 0, got {self.at_iteration!r}")
        for name in ("sp", "release", "by_operator"):
            if type(getattr(self, name)) is not bool:
                raise RequestError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if (self.action == "drain") != (self.rank is not None):
            raise RequestError("a drain request, and only a drain request, names a rank")
        if self.rank is not None and (type(self.rank) is not int or self.rank < 0):
            raise RequestError(f"rank must be an integer >= 0, got {self.rank!r}")
        if self.action == "drain":
            given = [n for n in ("tp", "pp", "dp", "members") if getattr(self, n) is not None]
            given += ["vpp"] * (self.vpp != 1) + ["sp"] * self.sp + ["release"] * self.release
            given += ["at_iteration"] * (self.at_iteration != 0)
            if given:
                raise RequestError(
                    f"a drain request takes no {', '.join(given)} (the drained rank exits at the "
                    "next step boundary)"
                )
        if self.pipelines is not None:
            if self.action != "layout" or any(type(s) is not int or s < 1 for s in self.pipelines):
                raise RequestError(
                    f"pipelines must be stage counts >= 1 of a layout request, got "
                    f"{self.pipelines!r}"
                )
            if any(getattr(self, n) is not None for n in ("pp", "cp", "members", "dp")):
                raise RequestError("pipelines replace pp, cp, members and dp: give only tp")
        if self.members is not None and self.dp is not None:
            raise RequestError("give members or dp, not both")
        if self.action == "scale":
            if self.members is None:
                raise RequestError("a scale request needs members")
            given = [n for n in ("tp", "pp", "cp", "dp") if getattr(self, n) is not None]
            given += ["vpp"] * (self.vpp != 1) + ["sp"] * self.sp
            if given:
                raise RequestError(
                    f"a scale request takes no {', '.join(given)} (its layout follows "
                    "--elastic-layout; a layout request sets the degrees)"
                )

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        return json.dumps({k: v for k, v in fields.items() if v is not None})

    @classmethod
    def from_dict(cls, fields: dict) -> Request:
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise RequestError(f"unknown request field(s) {', '.join(map(repr, unknown))}")
        if isinstance(fields.get("pipelines"), list):
            fields = {**fields, "pipelines": tuple(fields["pipelines"])}
        return cls(**fields)

    @classmethod
    def from_json(cls, text: str) -> Request:
        """The request stored as `text`; raises RequestError naming what is wrong."""
        return cls.from_dict(_read_object(text, "the request"))


@dataclass(frozen=True, kw_only=True)
class Reconfiguration:
    """Reconfiguration `epoch`: the new layout and members every process acts on at one step
    boundary, and the layout-free scalars the new layout goes on from."""

    epoch: int
    request: int | None = None
    """The operator request it answers (None: not asked for through the control store)."""
    event: str = "layout"
    """What asked for it: the request's action."""
    layout: Layout | HeteroLayout
    members: tuple[int, ...]
    release: tuple[int, ...] = ()
    """Processes that leave the job (they exit) rather than wait as standby."""
    old_layout: Layout | HeteroLayout
    old_members: tuple[int, ...]
    training: dict
    """The JSON of the trainer's TrainingState (progress, schedule, optimizer step, scaler)."""
    vocab_size: int
    """The model's vocabulary as trained (the tokenizer's)."""
    rejoin: int | None = None
    """A replacement host's workers join (event "rejoin"): every process first forms the
    default group of this rejoin epoch (megadyn/launch/rejoin.py)."""
    joining: tuple[int, ...] = ()
    """Those workers' ranks (they start as standby processes of the new default group)."""

    @property
    def iteration(self) -> int:
        """The iteration after which the layout changes."""
        return self.training["state"]["iteration"]

    def to_json(self) -> str:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["layout"] = layout_to_dict(self.layout)
        fields["old_layout"] = layout_to_dict(self.old_layout)
        return json.dumps(fields)

    @classmethod
    def from_dict(cls, fields: dict) -> Reconfiguration:
        return cls(
            **{
                **fields,
                "layout": layout_from_dict(fields["layout"]),
                "old_layout": layout_from_dict(fields["old_layout"]),
                "members": tuple(fields["members"]),
                "release": tuple(fields["release"]),
                "old_members": tuple(fields["old_members"]),
                "joining": tuple(fields.get("joining", ())),
            }
        )


def reconfiguration(
    trainer: ReshardableTrainer,
    epoch: int,
    layout: Layout,
    members,
    release,
    *,
    event: str = "layout",
    request: int | None = None,
) -> Reconfiguration:
    """The record every process acts on: new layout and members, and the layout-free scalars."""
    return Reconfiguration(
        epoch=epoch,
        request=request,
        event=event,
        layout=layout,
        members=tuple(members),
        release=tuple(release),
        old_layout=trainer.groups.layout,
        old_members=tuple(trainer.groups.grid.members),
        training=trainer.training_state_dict(),
        vocab_size=trainer.model_cfg.vocab_size,
    )


@dataclass(frozen=True)
class Finish:
    """The last epoch: the job is done and standby processes exit."""

    epoch: int

    def to_json(self) -> str:
        return json.dumps({"epoch": self.epoch, "event": "finish"})


def epoch_record(text: str) -> Reconfiguration | Finish:
    """The record the control store holds for one epoch."""
    fields = json.loads(text)
    if fields.get("event") == "finish":
        return Finish(fields["epoch"])
    return Reconfiguration.from_dict(fields)
