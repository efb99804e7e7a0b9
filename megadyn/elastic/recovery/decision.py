"""The survivors' decision after a failure: reports in, decision out (pure; no processes).

    decision = decide(cfg, model_cfg, backend, reports, dead)   # the lowest member
    decision.transition()            # what every survivor runs (transition.py)

A survivor reports the tensors it holds: those of the layout it trained under (its current
holding) and, when a recovery has not finished its first step yet, those it kept from before
that recovery (`Report.earlier`: a second failure while the first is handled may have taken
the only holder of a piece under the recovery's layout, while the layout before it still has a
replica on a survivor). Each holding is a view: (layout, members) at one step. The decision
tries the survivors' common current view first, then the earlier views, and in each view the
oldest step every holder reached; it reads only from survivors whose tensors are at that step
(transition.restrict). The new layout and members come from requests.replace_or_shrink, the
rule a drain and a failure share: a waiting standby process takes each lost member's place in
the same layout, else the layout for the processes left (requests.layout_for_remaining)
keeping the global batch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

from megadyn.core.hetero_layout import HeteroLayout, layout_from_dict, layout_to_dict
from megadyn.core.layout import Layout, LayoutError
from megadyn.elastic.config import JobConfig
from megadyn.elastic.planning.requests import replace_or_shrink
from megadyn.elastic.recovery.agreement import Report
from megadyn.elastic.reshard.plan import PlanError
from megadyn.elastic.transition import Transition, distopt_of, plan_from
from megadyn.models.config import GPTConfig

View = tuple[str, tuple[int, ...]]
"""(the layout as sorted JSON, its members): what one holding is laid out as."""


def holdings(report: Report) -> dict[View, tuple[int, int, dict]]:
    """A report's holdings by view: (index: 0 current, k the k-th earlier; step; training)."""
    out = {}
    if report.member:
        out[view_of(report.layout, report.members)] = (0, report.iteration, report.training)
    for k, h in enumerate(report.earlier, start=1):
        out.setdefault(view_of(h.layout, h.members), (k, h.iteration, h.training))
    return out


def view_of(layout: dict, members) -> View:
    return json.dumps(layout, sort_keys=True), tuple(members)


@dataclass(frozen=True, kw_only=True)
class RecoveryDecision:
    """The survivors' decision (the lowest member's, through the agreement's store)."""

    layout: Layout | HeteroLayout
    members: tuple[int, ...]
    old_layout: Layout | HeteroLayout
    """The layout of the holdings read from (the current one, or one kept from before)."""
    old_members: tuple[int, ...]
    group_count: int
    """Process-group names drawn so far by the survivor that drew most (all draw from there)."""
    vocab_size: int
    control: tuple[int, str]
    """The lowest survivor and its host: where the control store goes if its host died."""
    newest: int | None
    """The newest step a holder reached."""
    iteration: int | None
    """The step the survivors go on from."""
    sources: tuple[int, ...]
    """The survivors read from (empty: no survivor holds a replica; the snapshot)."""
    holding: dict[int, int]
    """For each source, the index of the holding it reads (0: current, k: the k-th earlier)."""
    training: dict | None
    """The TrainingState JSON at `iteration` (of the lowest source)."""
    missing: str | None = None
    """Why no survivor's tensors serve (then the snapshot is loaded)."""

    def transition(self) -> Transition:
        """The survivors' salvaged tensors (or the snapshot) to the new layout."""
        return Transition(
            old_layout=self.old_layout,
            old_members=self.old_members,
            layout=self.layout,
            members=self.members,
            training=self.training,
            vocab_size=self.vocab_size,
            sources=self.sources,
            holding=self.holding,
            missing=self.missing,
        )

    def to_dict(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["layout"] = layout_to_dict(self.layout)
        fields["old_layout"] = layout_to_dict(self.old_layout)
        fields["holding"] = {str(r): k for r, k in self.holding.items()}
        return fields

    @classmethod
    def from_dict(cls, fields: dict) -> RecoveryDecision:
        return cls(
            **{
                **fields,
                "layout": layout_from_dict(fields["layout"]),
                "old_layout": layout_from_dict(fields["old_layout"]),
                "members": tuple(fields["members"]),
                "old_members": tuple(fields["old_members"]),
                "control": tuple(fields["control"]),
                "sources": tuple(fields["sources"]),
                "holding": {int(r): k for r, k in fields["holding"].items()},
            }
        )


@dataclass(frozen=True)
class NoRecovery:
    """The survivors cannot go on in-process (the restart path follows)."""

    error: str

    def to_dict(self) -> dict:
        return {"error": self.error}


def decision_from_dict(fields: dict) -> RecoveryDecision | NoRecovery:
    """The decision as the agreement's store holds it."""
    return NoRecovery(fields["error"]) if "error" in fields else RecoveryDecision.from_dict(fields)


def decide(cfg: JobConfig, model_cfg: GPTConfig, backend: str, reports: dict[int, Report], dead):
    """The decision: the new layout and members, the step, the sources (and which of its
    holdings each reads from), or why the survivors cannot go on (NoRecovery; `missing` when no
    survivor holds a replica and only a snapshot can help). `cfg`: the job's."""
    held = {r: holdings(rep) for r, rep in reports.items()}
    current = {view_of(rep.layout, rep.members) for rep in reports.values() if rep.member}
    views = sorted(current) if len(current) == 1 else []
    views += [v for h in held.values() for v in h if v not in views]
    if not views:
        return NoRecovery(f"the survivors disagree on the layout they trained under: {current}")
    first = None
    for view in views:
        holders = {r: h[view] for r, h in held.items() if view in h}
        d = _decide_in_view(cfg, model_cfg, backend, reports, dead, view, holders)
        if isinstance(d, NoRecovery) or d.sources:
            return d
        first = d if first is None else first
    return first


def _decide_in_view(
    cfg: JobConfig, model_cfg: GPTConfig, backend, reports, dead, view: View, holders
):
    """The decision when the survivors rebuild from their holdings of `view`."""
    old_layout, old_members = layout_from_dict(json.loads(view[0])), list(view[1])
    waiting = [r for r in sorted(reports) if r not in old_members]
    old = SimpleNamespace(layout=old_layout, backend=backend)
    try:
        layout, new_members = replace_or_shrink(old, old_members, dead, waiting, model_cfg, cfg)
    except LayoutError as e:
        return NoRecovery(f"no layout for the survivors: {e}")
    steps = sorted({it for _, it, _ in holders.values() if it is not None})
    head = RecoveryDecision(
        layout=layout,
        members=tuple(new_members),
        old_layout=old_layout,
        old_members=tuple(old_members),
        group_count=max(rep.group_count for rep in reports.values()),
        vocab_size=model_cfg.vocab_size,
        control=(min(reports), reports[min(reports)].host),  # if its host died
        newest=max(steps, default=None),
        iteration=None,
        sources=(),
        holding={},
        training=None,
    )
    reason = "no survivor finished a step cleanly"
    distopt = partial(distopt_of, cfg)
    for it in steps:  # the oldest step first: every holder went that far
        sources = sorted(r for r, (_, step, _) in holders.items() if step == it)
        try:
            plan_from(model_cfg, distopt, old_layout, old_members, layout, new_members, sources)
        except PlanError as e:
            reason = f"no survivor holds a replica ({e})"
            continue
        return dataclasses.replace(
            head,
            iteration=it,
            sources=tuple(sources),
            holding={r: holders[r][0] for r in sources},
            training=holders[sources[0]][2],
        )
    at_newest = [r for r, (_, step, _) in holders.items() if step == head.newest]
    training = holders[min(at_newest)][2] if at_newest else None
    return dataclasses.replace(head, iteration=head.newest, training=training, missing=reason)
