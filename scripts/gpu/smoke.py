"""The GPU gate: every path of megadyn that only runs on GPUs, in one command on 2 GPUs.

On a machine of one GPU it runs what fits one GPU (the main job, the CUDA graph, FP8, save and
resume, c10d_compat on one NCCL rank: cuda_graph_1gpu, fp8_1gpu, save_resume_1gpu) and lists the
checks that need two as "not run"; its line says so and passes when every check it ran passed.

    bash scripts/gpu/smoke.sh OUTDIR                    # all checks, the line into docs/gpu-checks.jsonl
    bash scripts/gpu/smoke.sh OUTDIR --only fp8,live_change --no-record
    SMOKE_SKIP=main_job bash scripts/gpu/smoke.sh OUTDIR   # (or SMOKE_ONLY=...)
    python3 scripts/gpu/smoke.py OUTDIR --tiny --skip main_job --jobs 1   # CPU: the flow only

Prints one markdown table (also OUTDIR/table.md), one row per check: pass/fail and its figure;
appends one JSON line (date, commit, megadyn_tree, device, checks) to docs/gpu-checks.jsonl
(also OUTDIR/record.json) unless --no-record; writes OUTDIR/<check>.log (every process of the
check: its command, exit code, seconds and output) and OUTDIR/logs.tgz with all of them (the
device machine returns 8 files: table.md, record.json and logs.tgz are enough). Exits 0 only
when every check passed. Scratch (checkpoints, metrics files, corpora) goes to --work.

On the device machine (a copy of the tree, maybe without .git: pass the commit, and bring the
line back into the committed file):

    GATE_COMMIT=$(git rev-parse HEAD) GATE_TREE=$(git rev-parse HEAD:megadyn)   # here, then there:
    GATE_COMMIT=<sha> GATE_TREE=<sha> bash scripts/gpu/smoke.sh /tmp/gate; cp /tmp/gate/{table.md,record.json,logs.tgz} $OUT
    cat <files_at>/record.json >> docs/gpu-checks.jsonl                          # here, committed

Without GATE_TREE and .git, megadyn_tree is computed from megadyn/'s files (git's tree id:
equal to HEAD:megadyn when they are committed unchanged) and commit is "unknown". The
regression rule reads the previous lines of docs/gpu-checks.jsonl, so the copy must hold them.

Each check has its own timeout (a check over it fails with figure "timeout"; its processes,
worker trees included, are killed) and the gate a total budget (--budget-s): a check still
running at its end is stopped the same way, one not started fails with "no time". The four
checks whose figures are timings run first, one at a time, on an idle machine; the others
(losses and paths) then run --jobs at a time, sharing the GPUs.

Expected seconds on 2 x H100 (process start 15-25 s; the 1.42B model starts in ~30 s and
steps in ~0.35 s); about 6.5 minutes in all, 8 at most:
  main_job              ~50   scripts/train_default.sh --train-iters 30 (offline install, data
                              build, tp 2, 8 layers of 512)
  live_change           ~55   1.42B at dp 2, elastic_ctl: -> tp 2 at iteration 6, -> pp 2 at 14, 24 steps
  kill9_recovery        ~85   1.42B dp 2, 2 optimizer instances, 16 steps: kill -9 after 8
                              (megadyn.launch), then the same 16 steps uninterrupted
  lost_host             ~60   the same job on 2 GPUs as 2 hosts (one megadyn.launch agent each,
                              the coordinator a third process): the host of rank 0 (agent and
                              worker) SIGKILLed after 8, losses against the run above
  --- then 3 at a time (~150 s for these nine) ---
  cuda_graph_tp2        ~30   eager and --enable-cuda-graph side by side, tp 2, 8 steps, --deterministic-mode
  sigterm_drain         ~30   small model dp 2, SIGTERM to rank 1 after 10 of 100 steps
  cp2_a2a_docmask       ~40   cp 1 (1 GPU) beside cp 2 a2a, document masks, seq 4096, 10 steps
  cp2_p2p_docmask       ~30   cp 2 p2p (the cp 1 run shared with the check above)
  dynamic_cp_flex       ~40   --cp-placement dynamic (flex_attention) against the p2p run
  hot_switch            ~35   corpus, then static tp 2 beside --dynamic-parallelism, 6 steps
  fp8                   ~30   bf16 beside --fp8-format hybrid, tp 2 + SP, 10 steps
  save_resume_relayout  ~50   tp 2 saves at 5 of 10; pp 2 resumes from 5 (--ckpt-step 5)
  c10d_compat           ~15   python -m megadyn.core.c10d_compat (2 NCCL ranks if it takes --backend)
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gate_report as report  # noqa: E402
from gate_checks import CHECKS, ONE_GPU_NAMES, POOLED, TIMED, TWO_GPUS, Models  # noqa: E402
from gate_runner import RECORD_FILE, REPO, T0, Gate  # noqa: E402


# --- where and what ------------------------------------------------------------------------------
def git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def provenance() -> dict:
    """commit and megadyn_tree: GATE_COMMIT / GATE_TREE when given, else git; a copy without
    .git gets the tree id computed from megadyn/'s files (equal to HEAD:megadyn when they are
    committed unchanged) and commit "unknown"."""
    commit = os.environ.get("GATE_COMMIT") or git("rev-parse", "HEAD") or "unknown"
    tree = os.environ.get("GATE_TREE") or git("rev-parse", "HEAD:megadyn")
    out = {"commit": commit, "megadyn_tree": tree}
    if tree is None:
        out["megadyn_tree"] = report.git_tree_hash(REPO / "megadyn")
        out["megadyn_tree_from"] = "files"
    if os.environ.get("GATE_TREE"):  # the files must be that tree (the copy's .git may be old)
        dirty = report.git_tree_hash(REPO / "megadyn") != out["megadyn_tree"]
    else:
        dirty = bool(git("status", "--porcelain", "--", "megadyn"))
    if dirty:
        out["megadyn_dirty"] = True
    return out


def find_device(tiny: bool, gpus: int | None) -> dict:
    if tiny:  # --gpus 1 runs the one-GPU selection's flow
        return {"name": "cpu", "count": gpus or 0}
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        names = ""
    return report.device_of(names)


def run_all(gate: Gate, names: list[str], jobs: int) -> dict:
    """The timed checks one at a time, then the others `jobs` at a time. Stopped (Ctrl-C,
    SIGTERM), the gate kills every process it started: they run in sessions of their own,
    which outlive it."""
    pool = ThreadPoolExecutor(max(1, jobs))
    results = {}
    if gate.width == 1:
        gpus = gate.device["count"]
        results = {n: report.not_run(n, 2, gpus) for n in names if n in TWO_GPUS}
        names = [n for n in names if n not in TWO_GPUS]
    try:
        results.update({n: gate.run_check(n) for n in TIMED if n in names})
        pooled = {n: pool.submit(gate.run_check, n) for n in POOLED if n in names}
        while not all(f.done() for f in pooled.values()):
            time.sleep(0.2)  # not f.result(): a signal must reach the main thread meanwhile
        results.update({n: f.result() for n, f in pooled.items()})
    except BaseException:
        gate.stopping = True
        pool.shutdown(wait=False, cancel_futures=True)
        gate.kill_all()
        raise
    pool.shutdown()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir", type=Path)
    p.add_argument("--only", default=os.environ.get("SMOKE_ONLY", ""), help="checks to run: a,b")
    p.add_argument("--skip", default=os.environ.get("SMOKE_SKIP", ""), help="checks to leave out")
    p.add_argument(
        "--no-record", action="store_true", help="do not append to docs/gpu-checks.jsonl"
    )
    p.add_argument("--jobs", type=int, default=3, help="checks at a time after the timed ones")
    p.add_argument("--budget-s", type=float, default=480.0, help="the whole gate's seconds")
    p.add_argument("--work", type=Path, default=Path("/tmp/megadyn_smoke"), help="scratch dir")
    p.add_argument(
        "--tiny", action="store_true", help="CPU-sized models (flow only; never recorded)"
    )
    p.add_argument(
        "--gpus", type=int, help="with --tiny: 1 runs the one-GPU selection (default 2 ranks)"
    )
    p.add_argument("--list", action="store_true", help="print the checks and exit")
    a = p.parse_args(argv)
    if a.list:
        print("\n".join(CHECKS))
        return 0
    try:
        names = report.select_checks(list(CHECKS), a.only, a.skip)
    except ValueError as e:
        p.error(str(e))
    a.outdir.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    device = find_device(a.tiny, a.gpus)
    if not a.tiny and device["count"] == 0:
        p.error("no GPU found (nvidia-smi lists none); --tiny runs the flow on the CPU")
    where = provenance()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    print(
        f"GPU gate: {len(names)} checks on {device['count']} x {device['name']}, "
        f"commit {where['commit'][:12]}, budget {a.budget_s:.0f} s",
        flush=True,
    )
    gate = Gate(CHECKS, a.outdir, a.work, a.budget_s, Models.make(a.tiny), device)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM: clean up
    results = run_all(gate, names, a.jobs)
    ordered = [results[n] for n in names]
    if gate.width == 1:  # a check run at width 1 is another check: its own name
        for r in ordered:
            r.name = ONE_GPU_NAMES.get(r.name, r.name)
    table = report.render_table(ordered)
    (a.outdir / "table.md").write_text(table)
    record = report.build_record(
        ordered, date=date, device=device, seconds=round(time.monotonic() - T0), **where
    )
    line = report.record_line(record)
    (a.outdir / "record.json").write_text(line)
    with tarfile.open(a.outdir / "logs.tgz", "w:gz") as tar:
        for n in names:
            if (a.outdir / f"{n}.log").exists():
                tar.add(a.outdir / f"{n}.log", arcname=f"{n}.log")
    print("\n" + table, flush=True)
    if a.no_record or a.tiny:
        print("not recorded (--no-record or --tiny); the line is in record.json")
    else:
        with open(RECORD_FILE, "a") as f:
            f.write(line)
        print(f"appended to {RECORD_FILE.relative_to(REPO)} (also {a.outdir / 'record.json'})")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
