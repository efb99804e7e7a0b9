"""Kill one worker of a torchrun job and time the recovery: kill to the next completed step.

    python tools/bench_recovery.py --nproc 4 --kill-after 25 -- <pretrain_gpt.py flags>

Starts `torchrun --max-restarts 1` (c10d rendezvous) on pretrain_gpt.py with the given flags
(`--log-interval 1` and `--elastic-snapshot-interval` are the caller's), sends SIGKILL to one
worker once iteration `--kill-after` is logged, and prints one JSON line: the iteration killed
after, the snapshot the job resumed from, the seconds from the kill to the first iteration line
after the restart, and the job's own recovery line. The full log goes to `--log`, its lines after
the kill prefixed with the seconds since it (torchrun's agent logs at INFO level, so its
stopping, rendezvous and starting of the workers show there too).

    python tools/bench_recovery.py --in-process --nproc 2 --kill-after 25 -- <flags>

`--in-process` starts `python -m megadyn.launch --max-restarts 0` instead (the flags must turn
elastic mode on: --elastic-control-port): the survivors recover in the same processes, and the
job's line is its ` elastic: ... event: failure` line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

ITERATION = re.compile(r"iteration\s+(\d+)/")
RESUMED = re.compile(r"recovery: resuming from the in-memory snapshot \S*iter_(\d+)")
COMPLETE = re.compile(r"in-memory snapshot \S*iter_(\d+) complete")


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return sorted(int(x) for x in out.split())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--kill-after", type=int, required=True, help="iteration to kill after")
    p.add_argument(
        "--after-snapshot", type=int, default=0, help="kill only once this snapshot is complete"
    )
    p.add_argument("--victim", type=int, default=1, help="index of the worker to kill")
    p.add_argument("--log", default="recovery.log")
    p.add_argument("--port", type=int, default=29400)
    p.add_argument("--in-process", action="store_true", help="megadyn.launch, no restart")
    p.add_argument("pretrain_args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    flags = [x for x in a.pretrain_args if x != "--"]
    launcher, restarts = ("megadyn.launch", "0") if a.in_process else ("torch.distributed.run", "1")
    cmd = [sys.executable, "-m", launcher, "--nnodes", "1",
           "--nproc-per-node", str(a.nproc), "--max-restarts", restarts, "--monitor-interval", "0.1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{a.port}",
           "--rdzv-id", "bench-recovery", "pretrain_gpt.py", *flags]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", LOGLEVEL="INFO")  # the agent's steps too
    job = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    killed_at = back_at = last = resumed = None
    job_line, complete = None, 0
    with open(a.log, "w", buffering=1) as log:  # line by line: a timeout keeps what came
        for line in job.stdout:  # after the kill, each line with the seconds since it
            log.write(
                line if killed_at is None else f"[+{time.monotonic() - killed_at:.2f} s] {line}"
            )
            c = COMPLETE.search(line)
            complete = int(c.group(1)) if c and killed_at is None else complete
            m = ITERATION.search(line)
            ready = complete >= a.after_snapshot
            if m and killed_at is None and ready and int(m.group(1)) >= a.kill_after:
                last = int(m.group(1))
                os.kill(children(job.pid)[a.victim], signal.SIGKILL)
                killed_at = time.monotonic()
            elif m and (resumed is not None or a.in_process) and killed_at and back_at is None:
                back_at = time.monotonic()
            r = RESUMED.search(line)
            if r and killed_at is not None:
                resumed = int(r.group(1))
            if "recovery: restart" in line or "event: failure" in line:
                job_line = line.strip()
    code = job.wait()
    result = dict(
        exit_code=code,
        killed_after_iteration=last,
        newest_complete_snapshot_before_kill=complete,
        resumed_from_snapshot=resumed,
        kill_to_next_step_s=round(back_at - killed_at, 2) if back_at and killed_at else None,
        job_recovery_line=job_line,
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
