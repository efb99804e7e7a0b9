"""The GPU gate's pure parts: verdicts, the table, the JSON line of docs/gpu-checks.jsonl.

scripts/gpu/smoke.py runs the checks (processes on the GPUs) and hands what they wrote (metrics
records, log lines, exit codes) to these functions; tests/test_gpu_gate.py runs them on made-up
inputs. Nothing here starts a process or imports torch.

    result = CheckResult("fp8", passed=True, figure=0.004)
    print(render_table([result]))
    line = build_record([result], date=..., commit=..., megadyn_tree=..., device=...)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BF16_LOSS_TOL = 0.05
"""Largest absolute lm-loss difference two bf16 runs of the same samples may show when their
arithmetic differs (another layout, a recovery, a resume): bf16 noise over a few steps."""
FP8_REL_TOL = 0.03
"""Largest relative lm-loss difference of FP8 from bf16 over a few steps (BENCHMARKS.md saw
2.1% over 200 steps of the default job)."""
ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+)")


@dataclass
class CheckResult:
    """One row of the table and one entry of the JSON line's `checks`."""

    name: str
    passed: bool
    figure: float | int | str | None = None
    """The check's number (a loss difference, seconds) or a short string."""
    reason: str = ""
    """Why it failed (empty when it passed)."""
    seconds: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Further fields for the JSON line (every figure behind the short one)."""
    run: bool = True
    """False for a check the machine cannot run (it needs more GPUs than it has): neither a
    pass nor a failure, and said so in the table and the line."""

    def entry(self) -> dict[str, Any]:
        """The entry of the JSON line's `checks` list."""
        if not self.run:
            return {"name": self.name, "not_run": self.reason}
        d = {"name": self.name, "passed": self.passed, "figure": self.figure}
        if self.reason:
            d["reason"] = self.reason
        if self.seconds is not None:
            d["seconds"] = round(self.seconds, 1)
        return {**d, **self.extra}


def fail(name: str, figure, reason: str, **extra) -> CheckResult:
    return CheckResult(name, False, figure, reason, extra=extra)


# --- the table and the JSON line ---------------------------------------------------------------
def format_figure(figure) -> str:
    if isinstance(figure, float):
        return f"{figure:.4g}"
    return "-" if figure is None else str(figure)


def render_table(results: list[CheckResult]) -> str:
    """Markdown: one row per check (name, pass/fail, figure, seconds, why it failed)."""
    rows = ["| check | result | figure | seconds | reason |", "|---|---|---|---|---|"]
    for r in results:
        secs = "-" if r.seconds is None else f"{r.seconds:.0f}"
        reason = r.reason.replace("|", "/").replace("\n", " ")
        verdict = ("pass" if r.passed else "FAIL") if r.run else "not run"
        rows.append(f"| {r.name} | {verdict} | {format_figure(r.figure)} | {secs} | {reason} |")
    ran = [r for r in results if r.run]
    tail = f"{sum(r.passed for r in ran)} of {len(ran)} checks passed"
    if len(ran) < len(results):
        tail += f"; {len(results) - len(ran)} not run on this machine"
    return "\n".join(rows) + f"\n\n{tail}\n"


def not_run(name: str, gpus_needed: int, gpus: int) -> CheckResult:
    """The row of a check that needs more GPUs than the machine has."""
    reason = f"needs {gpus_needed} GPUs, the machine has {gpus}"
    return CheckResult(name, passed=False, figure="-", reason=reason, run=False)


def build_record(
    results: list[CheckResult],
    *,
    date: str,
    commit: str,
    megadyn_tree: str,
    device: dict[str, Any],
    **extra,
) -> dict[str, Any]:
    """The line appended to docs/gpu-checks.jsonl."""
    return {
        "date": date,
        "commit": commit,
        "megadyn_tree": megadyn_tree,
        "device": device,
        "passed": any(r.run for r in results) and all(r.passed for r in results if r.run),
        "checks": [r.entry() for r in results],
        **extra,
    }


def record_line(record: dict[str, Any]) -> str:
    """One JSON line; NaN and infinities as strings, so that any JSON reader takes it."""

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(record), allow_nan=False) + "\n"


def device_of(nvidia_smi_names: str) -> dict[str, Any]:
    """{name, count} from `nvidia-smi --query-gpu=name --format=csv,noheader` output."""
    names = [n.strip() for n in nvidia_smi_names.splitlines() if n.strip()]
    return {"name": names[0] if names else "unknown", "count": len(names)}


def select_checks(names: list[str], only: str = "", skip: str = "") -> list[str]:
    """The checks to run, in `names`' order: `only` and `skip` are comma-separated names."""
    want = [s.strip() for s in only.split(",") if s.strip()]
    drop = [s.strip() for s in skip.split(",") if s.strip()]
    unknown = sorted(set(want + drop) - set(names))
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(unknown)}; known: {', '.join(names)}")
    return [n for n in names if (not want or n in want) and n not in drop]


# --- reading what the runs wrote ----------------------------------------------------------------
def reference_model_flags(script_text: str) -> list[str]:
    """The REFERENCE_MODEL=( ... ) bash array of scripts/gpu/reference_model.sh, as flags."""
    m = re.search(r"^REFERENCE_MODEL=\((.*?)\)", script_text, re.S | re.M)
    if m is None:
        raise ValueError("no REFERENCE_MODEL=( ... ) array")
    return shlex.split(m.group(1), comments=True)


def parse_fields(line: str) -> dict[str, Any]:
    """The `key: value | key: value` fields of a log line such as ` elastic: epoch: 2 | event:
    failure | total_s: 1.2`, numbers as numbers (the text before the first key is dropped)."""
    body = line.split("elastic:", 1)[1] if "elastic:" in line else line
    out: dict[str, Any] = {}
    for part in body.split("|"):
        key, sep, value = part.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        try:
            out[key] = int(value)
        except ValueError:
            try:
                out[key] = float(value)
            except ValueError:
                out[key] = value
    return out


def last_iteration(log_text: str) -> int | None:
    """The iteration of the last iteration line in a log."""
    found = ITERATION_LINE.findall(log_text)
    return int(found[-1][0]) if found else None


def environ_value(environ: bytes, key: str) -> str | None:
    """A variable of /proc/<pid>/environ's NUL-separated bytes."""
    for item in environ.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep and k.decode(errors="replace") == key:
            return v.decode(errors="replace")
    return None


def losses(iteration_records: dict[int, dict]) -> dict[int, float]:
    """lm loss by iteration, from megadyn.training.metrics_log.iterations(...)."""
    return {i: float(r["losses"]["lm loss"]) for i, r in iteration_records.items()}


def max_loss_diff(
    a: dict[int, float], b: dict[int, float], after: int = 0, relative: bool = False
) -> tuple[float | None, int]:
    """The largest |a - b| (or |a - b| / |b|) over the iterations > `after` both logged, and how
    many there were; (None, 0) when none. A non-finite loss gives inf."""
    common = sorted(i for i in set(a) & set(b) if i > after)
    if not common:
        return None, 0
    worst = 0.0
    for i in common:
        if not (math.isfinite(a[i]) and math.isfinite(b[i])):
            return math.inf, len(common)
        d = abs(a[i] - b[i])
        worst = max(worst, d / abs(b[i]) if relative else d)
    return worst, len(common)


def compare_losses(
    name: str,
    runs: dict[str, int | None],
    loss: dict[int, float],
    ref: dict[int, float],
    *,
    iterations: list[int],
    tol: float,
    exact: bool = False,
    relative: bool = False,
    **extra,
) -> CheckResult:
    """Verdict of a run whose losses must equal a reference's (within `tol`, or bit for bit
    with `exact`) at every iteration of `iterations`; `runs` maps each run to its exit code."""
    bad = {k: v for k, v in runs.items() if v != 0}
    if bad:
        return fail(name, "run failed", ", ".join(f"{k} exit {v}" for k, v in bad.items()), **extra)
    missing = [i for i in iterations if i not in loss or i not in ref]
    diff, n = max_loss_diff(loss, ref, after=min(iterations) - 1, relative=relative)
    extra = {**extra, "iterations_compared": n, "tolerance": 0.0 if exact else tol}
    if missing:
        return fail(name, diff, f"iterations {missing[:5]} not logged by both runs", **extra)
    if diff is None or (diff != 0.0 if exact else not diff < tol):
        kind = "relative " if relative else ""
        return fail(name, diff, f"max {kind}loss difference {diff} above {tol}", **extra)
    return CheckResult(name, True, diff, extra=extra)


# --- verdicts of the checks with rules of their own -------------------------------------------
def main_job_verdict(code: int | None, records: dict[int, dict]) -> CheckResult:
    """The README's main job: exit 0 and a last logged loss below the first."""
    name = "main_job"
    if code != 0:
        return fail(name, f"exit {code}", "scripts/train_default.sh failed")
    if len(records) < 2:
        return fail(name, None, f"{len(records)} iteration record(s) in the metrics file")
    loss = losses(records)
    first, last = loss[min(loss)], loss[max(loss)]
    rates = [r.get("tokens_per_sec") for i, r in records.items() if i != min(records)]
    rates = sorted(x for x in rates if x)
    tps = rates[len(rates) // 2] if rates else None
    extra = {"first_loss": first, "last_loss": last, "tokens_per_s": tps, "iterations": max(loss)}
    figure = f"loss {last:.3f}, {tps / 1e3:.1f}k tok/s" if tps else f"loss {last:.3f}"
    if not last < first:
        return fail(name, figure, f"loss did not fall ({first:.3f} -> {last:.3f})", **extra)
    return CheckResult(name, True, figure, extra=extra)


def recovery_verdict(
    bench: dict[str, Any] | None,
    base_code: int | None,
    recovered: dict[int, float],
    uninterrupted: dict[int, float],
    train_iters: int,
    max_kill_to_step_s: float = 3.0,
    max_repeated: int = 1,
    name: str = "kill9_recovery",
) -> CheckResult:
    """kill -9 under `python -m megadyn.launch`: the timing script's JSON line (`bench`:
    tools/bench_recovery.py's, or scripts/gpu/lost_host.py's for a lost host), the recovered
    run's losses against an uninterrupted run's after the kill."""
    if not bench:
        return fail(name, "no result", "its timing script printed no JSON line")
    line = parse_fields(bench.get("job_recovery_line") or "")
    kill_s, repeated = bench.get("kill_to_next_step_s"), line.get("repeated")
    after = bench.get("killed_after_iteration") or 0
    diff, n = max_loss_diff(recovered, uninterrupted, after=after)
    extra = {
        "kill_to_next_step_s": kill_s,
        "repeated": repeated,
        "max_loss_diff": diff,
        "iterations_compared": n,
        "killed_after": after,
        "job_total_s": line.get("total_s"),
        "new_layout": line.get("new"),
    }
    figure = f"{kill_s} s, repeated {repeated}, loss diff {format_figure(diff)}"
    problems = []
    if bench.get("exit_code") != 0 or base_code != 0:
        problems.append(f"exit codes: recovery {bench.get('exit_code')}, uninterrupted {base_code}")
    if not line:
        problems.append("no ' elastic: ... event: failure' line")
    if kill_s is None or kill_s >= max_kill_to_step_s:
        problems.append(f"kill to next step {kill_s} s (must be < {max_kill_to_step_s})")
    if not isinstance(repeated, int) or repeated > max_repeated:
        problems.append(f"steps repeated {repeated} (must be <= {max_repeated})")
    if max(recovered, default=0) != train_iters or n != train_iters - after:
        problems.append(f"{n} iterations after the kill compared, of {train_iters - after}")
    if diff is None or not diff < BF16_LOSS_TOL:
        problems.append(f"loss difference {diff} not below {BF16_LOSS_TOL}")
    if problems:
        return fail(name, figure, "; ".join(problems), **extra)
    return CheckResult(name, True, figure, extra=extra)


def drain_verdict(
    code: int | None, log_text: str, records: list[dict], train_iters: int
) -> CheckResult:
    """SIGTERM to rank 1: a drain event to dp 1, and the survivor finishes every iteration."""
    name = "sigterm_drain"
    drains = [
        r for r in records if r.get("record") == "reconfiguration" and r.get("event") == "drain"
    ]
    done = max((r["iteration"] for r in records if r.get("record") == "iteration"), default=0)
    extra = {
        "events": [{k: r.get(k) for k in ("iteration", "old", "new", "total_s")} for r in drains]
    }
    figure = (
        f"{drains[0]['old']}->{drains[0]['new']} {drains[0].get('total_s')} s"
        if drains
        else "no drain"
    )
    problems = []
    if code != 0:
        problems.append(f"job exit {code}")
    if not re.search(r" elastic: .*event: drain", log_text):
        problems.append("no ' elastic: ... event: drain' line")
    if not drains or not str(drains[0].get("new", "")).endswith("dp1"):
        problems.append(f"drain events {extra['events']}, expected one to dp 1")
    if done != train_iters:
        problems.append(f"ended at iteration {done} of {train_iters}")
    if problems:
        return fail(name, figure, "; ".join(problems), **extra)
    return CheckResult(name, True, figure, extra=extra)


# --- where the code came from --------------------------------------------------------------------
def git_tree_hash(path: Path, skip=("__pycache__", ".pyc", ".egg-info")) -> str | None:
    """The git tree id of directory `path` as its files are now (what `git rev-parse
    HEAD:<path>` prints when they are committed unchanged): for a copy without .git. Skips
    bytecode caches; a file is 100755 when its owner may execute it; None for a directory
    with nothing git would keep."""
    entries = []
    for name in os.listdir(path):
        if any(name.endswith(s) for s in skip):
            continue
        p = path / name
        if p.is_symlink():
            mode, sha = b"120000", _object(b"blob", os.readlink(p).encode())
        elif p.is_dir():
            mode, sha = b"40000", git_tree_hash(p, skip)
            if sha is None:
                continue  # git keeps no empty directory
        else:
            mode = b"100755" if os.stat(p).st_mode & 0o100 else b"100644"
            sha = _object(b"blob", p.read_bytes())
        # git sorts a tree's entries by name, a directory's as if it ended in "/"
        key = name.encode() + (b"/" if mode == b"40000" else b"")
        entries.append((key, mode + b" " + name.encode() + b"\0" + bytes.fromhex(sha)))
    if not entries:
        return None
    return _object(b"tree", b"".join(e for _, e in sorted(entries)))


def _object(kind: bytes, body: bytes) -> str:
    return hashlib.sha1(kind + b" " + str(len(body)).encode() + b"\0" + body).hexdigest()
