"""Lose a whole host and time the survivors' recovery: the kill to their next completed step.

    python scripts/gpu/lost_host.py --hosts 2 --nproc-per-host 1 --kill-after 12 \\
        --log OUT/lost_host.log -- <pretrain_gpt.py flags, elastic mode>

Starts `python -m megadyn.launch.coordinator` and one `python -m megadyn.launch --coordinator`
agent per simulated host (MEGADYN_HOST=h0, h1, ...; with `--gpus 0,1` each host gets its share of
them through CUDA_VISIBLE_DEVICES), `--max-restarts 0`. Once iteration `--kill-after` is logged
it SIGKILLs the agent whose workers include rank 0 together with those workers (the host of
rank 0: it led the job and hosted its control store), and prints one JSON line: the surviving
agents' exit code and every agent's, the iteration killed after, the seconds from the kill to
the line of the first step completed after the recovery, and the job's recovery line. The merged log goes to `--log`, each line after
the kill prefixed with the seconds since it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

from megadyn.bench.recovery import ITERATION, children


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        return int(env[b"RANK"])
    except (OSError, KeyError, ValueError):
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--nproc-per-host", type=int, default=1)
    p.add_argument("--kill-after", type=int, required=True, help="iteration to kill after")
    p.add_argument("--host-timeout", type=float, default=2.0, help="python -m megadyn.launch's")
    p.add_argument(
        "--gpus", default="", help="GPUs to split over the hosts, e.g. 0,1 (default: none, CPU)"
    )
    p.add_argument("--log", default="lost_host.log")
    p.add_argument("pretrain_args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    flags = [x for x in a.pretrain_args if x != "--"]
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "megadyn.launch.coordinator", "--host", "127.0.0.1",
         "--port", str(port)], env=env,
    )  # fmt: skip
    read, write = os.pipe()
    agents = []
    gpus = a.gpus
    for h in range(a.hosts):
        host_env = dict(env, MEGADYN_HOST=f"h{h}")
        if gpus:
            mine = gpus.split(",")[h * a.nproc_per_host : (h + 1) * a.nproc_per_host]
            host_env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
        cmd = [sys.executable, "-m", "megadyn.launch", "--nnodes", str(a.hosts),
               "--nproc-per-node", str(a.nproc_per_host), "--max-restarts", "0",
               "--monitor-interval", "0.1", "--coordinator", f"127.0.0.1:{port}",
               "--rdzv-id", "lost-host", "--host-timeout", str(a.host_timeout),
               "pretrain_gpt.py", *flags]  # fmt: skip
        agents.append(subprocess.Popen(cmd, env=host_env, stdout=write, stderr=subprocess.STDOUT))
        time.sleep(0.5)
    os.close(write)
    killed_at = back_at = seen_at = last = job_line = None
    with open(a.log, "w", buffering=1) as log, os.fdopen(read) as stream:
        for line in stream:
            log.write(
                line if killed_at is None else f"[+{time.monotonic() - killed_at:.2f} s] {line}"
            )
            m = ITERATION.search(line)
            if m and killed_at is None and int(m.group(1)) >= a.kill_after:
                last = int(m.group(1))
                lost = next(g for g in agents if 0 in map(rank_of, children(g.pid)))
                for pid in [lost.pid, *children(lost.pid)]:
                    os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
            elif m and killed_at is not None:
                seen_at = time.monotonic()  # a step the survivors finished after the kill
            if "event: failure" in line and killed_at is not None and back_at is None:
                # printed after the first step since the recovery, whose line came just before
                # (an earlier one may be a step that was done before the kill reached it)
                job_line, back_at = line.strip(), seen_at
    codes = [g.wait() for g in agents]
    coordinator.kill()
    survivors = [code for g, code in zip(agents, codes) if killed_at is None or g is not lost]
    result = dict(
        exit_code=max(survivors, key=abs),  # the survivors' agents': 0 when they all finished
        exit_codes=codes,
        killed_after_iteration=last,
        kill_to_next_step_s=round(back_at - killed_at, 2) if back_at and killed_at else None,
        job_recovery_line=job_line,
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
