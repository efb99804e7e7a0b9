"""The gate's live layout changes (smoke.py's live_change check): what each change and the first
step after it cost, from the job's metrics records, against the bounds and the regression rule
(the median of the last lines of docs/gpu-checks.jsonl from the same device). Pure functions, as
gate_report.py's; tests/test_gpu_gate.py runs them on made-up records.

    changes = live_changes(records)
    problems = live_change_problems(changes, previous_check(lines, device, "live_change"), device)
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from gate_report import CheckResult, fail

REGRESSION = 1.25
"""A live change more than 25% slower (total or first step) than the same change's median over
the last REGRESSION_LINES lines of docs/gpu-checks.jsonl from the same device fails."""
REGRESSION_LINES = 3
"""How many earlier lines the regression rule takes the median of: one unusually fast run (tp 2
-> pp 2 took 0.16 s once among 0.21-0.23 s) must not set the bar for the next."""
LIVE_CHANGE_BOUNDS = {
    # dp 2 -> tp 2 of the 1.42B reference model on H100 / H200 (issue 36): the reshard and
    # rebuild at most 0.8 s; the first step after it at most 1.0 s longer than the steps that
    # follow it (0.66 and 0.70 s longer on H200 in the fourteenth and fifteenth sessions,
    # whose steps take 0.63-0.81 s at tp 2; it builds the tp group's NCCL communicator, 0.17 s
    # for its first all-reduce on an H200 pair, and runs the new shapes' kernels first)
    "tp1xpp1xdp2->tp2xpp1xdp1": {"total_s": 0.8, "first_step_extra_s": 1.0},
}
LIVE_CHANGE_RULED = ("total_s", "first_step_extra_s")
"""The seconds of a live change that the bounds and the regression rule look at."""
STEADY_STEPS = 4
"""How many iterations after the first one (and before the next change) give a layout's step."""
BOUNDED_DEVICES = ("H100", "H200")
"""LIVE_CHANGE_BOUNDS hold on GPUs whose name contains one of these."""


def previous_check(lines: list[str], device_name: str, check: str) -> dict[str, Any] | None:
    """The entry of `check` the regression rule compares with: from the last REGRESSION_LINES
    lines of docs/gpu-checks.jsonl from a device of the same name that ran it (lines that do
    not parse are skipped), each change's seconds are the median over those lines (a figure that
    not all of them hold is left out: one run is no median)."""
    entries = []
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or record.get("device", {}).get("name") != device_name:
            continue
        entry = next((e for e in record.get("checks", []) if e.get("name") == check), None)
        if entry is not None and (entry.get("changes") or check != "live_change"):
            entries.append(entry)  # a live_change entry without changes (1 GPU) is skipped
        if len(entries) == REGRESSION_LINES:
            break
    if not entries:
        return None
    seconds: dict[str, dict[str, list[float]]] = {}
    for entry in entries:
        for c in entry.get("changes", []):
            for key, value in c.items():
                if key != "change" and isinstance(value, (int, float)):
                    seconds.setdefault(c["change"], {}).setdefault(key, []).append(value)
    changes = [  # a key that some of these lines lack (a newer measure) has no median yet
        {
            "change": c,
            **{k: statistics.median(v) for k, v in keys.items() if len(v) == len(entries)},
        }
        for c, keys in seconds.items()
    ]
    return {**entries[0], "changes": changes, "lines": len(entries)}


def live_changes(records: list[dict]) -> list[dict[str, Any]]:
    """Each operator layout change of a metrics file: old->new and its seconds: the change's
    (total, rebuild); the logged iteration after it (`first_iteration_s`: it counts from the
    previous iteration's end, so it holds the change too); the new layout's step (`step_s`, the
    median of the next STEADY_STEPS iterations before any other change); and what the first step
    costs beyond one of those (`first_step_extra_s` = first_iteration_s - total_s - step_s)."""
    steps = {r["iteration"]: r for r in records if r.get("record") == "iteration"}
    layout = [
        r for r in records if r.get("record") == "reconfiguration" and r.get("event") == "layout"
    ]
    out = []
    for i, r in enumerate(layout):
        it, total = r["iteration"], r.get("total_s")
        stop = layout[i + 1]["iteration"] if i + 1 < len(layout) else max(steps, default=it)
        after = steps.get(it + 1)
        first = None if after is None else round(after["elapsed_ms"] / 1e3, 4)
        steady = [
            steps[j]["elapsed_ms"] / 1e3
            for j in range(it + 2, min(it + 2 + STEADY_STEPS, stop + 1))
            if j in steps
        ]
        step = round(statistics.median(steady), 4) if steady else None
        extra = None
        if first is not None and step is not None and isinstance(total, (int, float)):
            extra = round(first - total - step, 4)
        out.append(
            {
                "change": f"{r['old']}->{r['new']}",
                "iteration": it,
                "total_s": total,
                "rebuild_s": r.get("rebuild_s"),
                "first_iteration_s": first,
                "step_s": step,
                "first_step_extra_s": extra,
            }
        )
    return out


def live_change_problems(
    changes: list[dict[str, Any]], previous: dict[str, Any] | None, device_name: str
) -> list[str]:
    """Why the live changes fail the gate: over the hard bound (H100/H200) or more than
    REGRESSION x the same change's seconds in `previous` (`previous_check`: the median over
    the last lines of the same device)."""
    problems = []
    before = {c["change"]: c for c in (previous or {}).get("changes", [])}
    bounded = any(d in device_name for d in BOUNDED_DEVICES)
    for c in changes:
        for key in LIVE_CHANGE_RULED:
            now = c.get(key)
            if now is None:
                problems.append(f"{c['change']}: no {key}")
                continue
            bound = LIVE_CHANGE_BOUNDS.get(c["change"], {}).get(key)
            if bounded and bound is not None and now > bound:
                problems.append(f"{c['change']} {key} {now:.2f} s > bound {bound} s")
            old = before.get(c["change"], {}).get(key)
            if isinstance(old, (int, float)) and old > 0 and now > REGRESSION * old:
                problems.append(
                    f"{c['change']} {key} {now:.2f} s > {REGRESSION} x previous {old:.2f} s "
                    "(the median of the last runs on this device)"
                )
    return problems


def live_change_verdict(
    codes: dict[str, int | None],
    records: list[dict],
    expected: list[str],
    train_iters: int,
    previous: dict[str, Any] | None,
    device_name: str,
) -> CheckResult:
    """Both changes applied (`expected`: their new layouts, in order), the job finished, and
    their seconds within the bounds and the regression rule."""
    name = "live_change"
    changes = live_changes(records)
    extra = {"changes": changes}
    figure = "; ".join(
        f"{c['change'].split('->')[1]} {c['total_s']} s (rebuild {c['rebuild_s']}, first "
        f"step +{c['first_step_extra_s']} s over {c['step_s']})"
        for c in changes
    )
    bad = {k: v for k, v in codes.items() if v != 0}
    if bad:
        return fail(name, figure or "run failed", f"exit codes {bad}", **extra)
    got = [c["change"].split("->")[1] for c in changes]
    if got != expected:
        return fail(name, figure, f"layouts {got}, expected {expected}", **extra)
    done = max((r["iteration"] for r in records if r.get("record") == "iteration"), default=0)
    if done != train_iters:
        return fail(name, figure, f"job ended at iteration {done} of {train_iters}", **extra)
    problems = live_change_problems(changes, previous, device_name)
    if problems:
        return fail(name, figure, "; ".join(problems), **extra)
    return CheckResult(name, True, figure, extra=extra)
