"""The survivors' decision after a failure: reports in, decision out (pure; no processes).

    decision = decide(controller, model_cfg, backend, reports, dead)   # the lowest member

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

import json
from types import SimpleNamespace

from megadyn.core.hetero_layout import layout_from_dict, layout_to_dict
from megadyn.core.layout import LayoutError
from megadyn.elastic.agreement import Report
from megadyn.elastic.planner import PlanError
from megadyn.elastic.requests import replace_or_shrink
from megadyn.elastic.transition import plan_from

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


def decide(controller, model_cfg, backend: str, reports: dict[int, Report], dead) -> dict:
    """The decision: the new layout and members, the step, the sources (and which of its
    holdings each reads from), or why the survivors cannot go on ("error"; "missing" when no
    survivor holds a replica and only a snapshot can help)."""
    held = {r: holdings(rep) for r, rep in reports.items()}
    current = {view_of(rep.layout, rep.members) for rep in reports.values() if rep.member}
    views = sorted(current) if len(current) == 1 else []
    views += [v for h in held.values() for v in h if v not in views]
    if not views:
        return {"error": f"the survivors disagree on the layout they trained under: {current}"}
    first = None
    for view in views:
        holders = {r: h[view] for r, h in held.items() if view in h}
        d = _decide_in_view(controller, model_cfg, backend, reports, dead, view, holders)
        if "error" in d or d["sources"]:
            return d
        first = first or d
    return first


def _decide_in_view(controller, model_cfg, backend, reports, dead, view: View, holders) -> dict:
    """The decision when the survivors rebuild from their holdings of `view`."""
    old_layout, old_members = layout_from_dict(json.loads(view[0])), list(view[1])
    waiting = [r for r in sorted(reports) if r not in old_members]
    old = SimpleNamespace(layout=old_layout, backend=backend)
    try:
        layout, new_members = replace_or_shrink(
            old, old_members, dead, waiting, model_cfg, controller.cfg
        )
    except LayoutError as e:
        return {"error": f"no layout for the survivors: {e}"}
    head = {
        "layout": layout_to_dict(layout),
        "members": new_members,
        "old_layout": layout_to_dict(old_layout),
        "old_members": old_members,
        "group_count": max(rep.group_count for rep in reports.values()),
        "vocab_size": model_cfg.vocab_size,
        "control": [min(reports), reports[min(reports)].host],  # if its host died
    }
    steps = sorted({it for _, it, _ in holders.values() if it is not None})
    head["newest"] = max(steps, default=None)
    reason = "no survivor finished a step cleanly"
    for it in steps:  # the oldest step first: every holder went that far
        sources = sorted(r for r, (_, step, _) in holders.items() if step == it)
        try:
            plan_from(
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
        return {
            **head,
            "iteration": it,
            "sources": sources,
            "holding": {str(r): holders[r][0] for r in sources},
            "training": holders[sources[0]][2],
        }
    newest = head["newest"]
    at_newest = [r for r, (_, step, _) in holders.items() if step == newest]
    training = holders[min(at_newest)][2] if at_newest else None
    return {**head, "iteration": newest, "sources": [], "training": training, "missing": reason}
