"""Recovery path: `kill -9` of one of 4 workers under torchrun; the job restarts from the newest
complete in-memory snapshot and trains exactly like an uninterrupted run."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_live_reconfiguration import ARGS, plain_run  # noqa: E402

from megadyn.testing import free_port, spawn

REPO = Path(__file__).resolve().parents[2]
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|")


def args(iters: int) -> list[str]:
    a = [x if x != "10" else str(iters) for x in ARGS]
    a[a.index("--lr") + 1], a[a.index("--min-lr") + 1] = "1e-3", "1e-4"
    return a


def workers_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return kids


def test_kill_one_worker_recovers_from_snapshot(tmp_path):
    iters, interval = 40, 4
    reference = spawn(plain_run, world=1, args=(args(iters),))[0]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "4",
        "--max-restarts",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        "recovery-test",
        "pretrain_gpt.py",
        *args(iters),
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--elastic-snapshot-interval",
        str(interval),
        "--elastic-snapshot-dir",
        str(tmp_path / "shm"),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    job = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    log, killed_at, seen, recovered_at = [], None, 0, None
    deadline = time.monotonic() + 240
    for line in job.stdout:
        log.append(line)
        m = LINE.search(line)
        if m:
            seen = int(m.group(1))
            if killed_at is not None and recovered_at is None and "resuming" in "".join(log[-50:]):
                recovered_at = time.monotonic()
        if killed_at is None and seen >= 10:
            victim = sorted(workers_of(job.pid))[1]
            os.kill(victim, signal.SIGKILL)
            killed_at, last_before = time.monotonic(), seen
        if time.monotonic() > deadline:
            job.kill()
            break
    assert job.wait(timeout=60) == 0, "".join(log[-40:])
    text = "".join(log)
    m = re.search(r"recovery: resuming from the in-memory snapshot .*iter_(\d+)", text)
    assert m, text[-3000:]
    resumed = int(m.group(1))
    assert last_before - resumed <= interval + 1  # the lost work is at most a snapshot interval
    losses = {}
    for it, loss in LINE.findall(text):
        losses[int(it)] = float(loss)  # after recovery the re-run steps overwrite the first ones
    assert sorted(losses) == list(range(1, iters + 1))
    for i, want in enumerate(reference, start=1):
        assert abs(losses[i] - want) <= 1e-5 * abs(want), (i, losses[i], want)
    print(
        f"recovery: killed after iteration {last_before}, resumed from snapshot {resumed}, "
        f"kill to next completed step {recovered_at - killed_at:.1f} s"
    )
