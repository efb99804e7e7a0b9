"""One GPU slowed by a competing process: tokens/s under --elastic-straggler-policy log and under
an action (issue 39's GPU figure).

    python3 scripts/gpu/straggler.py --out OUTDIR --policies log,rebalance,exclude \\
        --slow-after 10 --iters 60 -- <pretrain_gpt.py flags of a dp 2 job>

For each policy, one job of `--nproc` workers (torchrun; the flags must make it dp 2 or more),
with `--log-straggler` and that policy; once iteration `--slow-after` is logged, a competitor
starts on GPU `--slow-gpu`: a loop of bf16 matmuls (`--competitor-size`) in a process of its
own, which the GPU time-slices with the worker there (about half speed each). It is stopped
when the job ends. On a machine without GPUs the competitor is a loop of CPU matmuls (the
script's flow only; every rank shares the cores).

Prints one JSON line per policy and a last one comparing them, all also in OUTDIR/straggler.jsonl:
  before_tps   median tokens/s of the iterations before the competitor (the first 3 dropped)
  slowed_tps   median tokens/s of the last `--tail` iterations (the competitor running; under an
               action, after it)
  action       the job's ` elastic: straggler: ...` line (its iteration, before/after step s)
  named        the job's ` straggler: slowest rank ...` line first naming a straggler
and in the last line each action's slowed_tps over log's. Each job's log is OUTDIR/<policy>.log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from megadyn.bench.recovery import ITERATION  # noqa: E402
from megadyn.training.metrics_log import iterations, read_metrics  # noqa: E402

POLICY_FLAGS = {
    "log": [],
    "exclude": ["--elastic-straggler-policy", "exclude"],
    "rebalance": ["--heterogeneous-pipelines", "--elastic-straggler-policy", "rebalance"],
}
ACTION = re.compile(r" elastic: straggler: .*")
NAMED = re.compile(r" straggler: slowest rank .*\| rank \d+ is a straggler")
COMPETITOR = """
import sys, torch
n = int(sys.argv[1])
if torch.cuda.is_available():
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
else:
    torch.set_num_threads(1)
    a = torch.randn(n // 8, n // 8)
print("competitor running", flush=True)
while True:
    for _ in range(20):
        b = a @ a
    if a.is_cuda:
        torch.cuda.synchronize()
"""


def start_competitor(gpu: int, size: int) -> subprocess.Popen:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu))
    return subprocess.Popen(
        [sys.executable, "-c", COMPETITOR, str(size)], env=env, start_new_session=True
    )


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tokens_per_s(metrics: Path) -> dict[int, float]:
    """Iteration -> tokens/s of the job's --metrics-file (a line cut short by a kill skipped)."""
    logged = iterations(read_metrics(metrics)) if metrics.exists() else {}
    return {i: r["tokens_per_sec"] for i, r in logged.items() if r.get("tokens_per_sec")}


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def run_policy(a: argparse.Namespace, policy: str, flags: list[str], port: int) -> dict:
    out = Path(a.out)
    metrics, log_path = out / f"{policy}.metrics.jsonl", out / f"{policy}.log"
    metrics.unlink(missing_ok=True)
    flags = [*flags, *POLICY_FLAGS[policy], "--metrics-file", str(metrics)]
    if policy != "log":
        flags += ["--elastic-control-port", str(port)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(a.nproc), "pretrain_gpt.py", *flags]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    competitor, slowed_at = None, None
    with open(log_path, "w") as log:
        job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
        # a job past --timeout is killed even when it prints nothing more
        deadline = threading.Timer(a.timeout, lambda: os.killpg(job.pid, signal.SIGKILL))
        deadline.start()
        try:
            for line in job.stdout:
                log.write(line)
                m = ITERATION.search(line)
                if competitor is None and m and int(m.group(1)) >= a.slow_after:
                    competitor, slowed_at = (
                        start_competitor(a.slow_gpu, a.competitor_size),
                        int(m.group(1)),
                    )
            code = job.wait()
        finally:
            deadline.cancel()
            stop(competitor)
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    text = log_path.read_text()
    tps = tokens_per_s(metrics)
    before = [v for i, v in tps.items() if 3 < i <= (slowed_at or 0)]
    tail = sorted(tps)[-a.tail :]
    action = ACTION.search(text)
    named = NAMED.search(text)
    return {
        "policy": policy, "exit_code": code, "slowed_after_iteration": slowed_at,
        "iterations": len(tps), "before_tps": median(before),
        "slowed_tps": median([tps[i] for i in tail]), "tail_iterations": [tail[0], tail[-1]] if tail else None,
        "action": action.group(0).strip() if action else None,
        "named": named.group(0).strip() if named else None,
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/megadyn_straggler")
    p.add_argument("--policies", default="log,rebalance")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--slow-after", type=int, default=10, help="iteration to start the competitor")
    p.add_argument("--slow-gpu", type=int, default=1)
    p.add_argument("--competitor-size", type=int, default=8192)
    p.add_argument("--tail", type=int, default=10, help="iterations of the slowed figure")
    p.add_argument("--port", type=int, default=29660, help="--elastic-control-port of actions")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per job")
    p.add_argument("pretrain_args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    flags = [x for x in a.pretrain_args if x != "--"]
    Path(a.out).mkdir(parents=True, exist_ok=True)
    results = []
    with open(Path(a.out) / "straggler.jsonl", "w") as f:
        for policy in a.policies.split(","):
            r = run_policy(a, policy, flags, a.port)
            results.append(r)
            print(json.dumps(r), flush=True)
            f.write(json.dumps(r) + "\n")
        log = next((r for r in results if r["policy"] == "log"), None)
        ratios = {
            r["policy"]: round(r["slowed_tps"] / log["slowed_tps"], 3)
            for r in results
            if log and r is not log and r["slowed_tps"] and log["slowed_tps"]
        }
        summary = {"summary": "slowed tokens/s over log's", **ratios}
        print(json.dumps(summary), flush=True)
        f.write(json.dumps(summary) + "\n")
    return 0 if all(r["exit_code"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
