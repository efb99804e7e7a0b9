"""Restart path under torchrun beyond a plain `kill -9`: a hung (stopped) worker is named by the
heartbeats and the job restarts; the restarted job logs its recovery time."""

import os
import signal
import subprocess
import time

from recovery_helpers import (  # noqa: E402
    LINE,
    REPO,
    args,
    assert_matches_reference,
    rank_of,
    recovery_times,
    torchrun_cmd,
    workers_of,
)

from megadyn.testing import free_port, run_pretrain, spawn

TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def run_job(cmd: list[str], on_line, deadline_s: float = 240) -> tuple[int, str]:
    """Run a torchrun job to its end; `on_line(line, job)` sees every output line. Every process
    the test stopped or started is killed at the end, whatever happened."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    job = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    log, deadline = [], time.monotonic() + deadline_s
    try:
        for line in job.stdout:
            log.append(line)
            on_line(line, job)
            if time.monotonic() > deadline:
                break
        return job.wait(timeout=60), "".join(log)
    finally:
        for pid in workers_of(job.pid):
            os.kill(pid, signal.SIGKILL)
        job.kill()
        job.wait()


def test_a_stopped_worker_is_named_and_the_job_restarts(tmp_path):
    iters, timeout = 24, 5
    reference = spawn(run_pretrain, world=1, args=(args(iters),))[0]
    cmd = torchrun_cmd(
        [
            "pretrain_gpt.py",
            *args(iters),
            *TP2_PP2,
            "--elastic-snapshot-interval",
            "4",
            "--elastic-snapshot-dir",
            str(tmp_path / "shm"),
            "--elastic-heartbeat-timeout",
            str(timeout),
        ],
        nproc=4,
        endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=1,
    )
    stopped = {}

    def on_line(line, job):
        m = LINE.search(line)
        if m and int(m.group(1)) >= 10 and not stopped:  # hang a worker: SIGSTOP, not a kill
            pid = sorted(workers_of(job.pid))[1]
            stopped.update(pid=pid, rank=rank_of(pid), at=time.monotonic())
            os.kill(pid, signal.SIGSTOP)

    try:
        rc, text = run_job(cmd, on_line)
    finally:
        if stopped:
            try:
                os.kill(stopped["pid"], signal.SIGKILL)  # nothing may outlive the test
            except ProcessLookupError:
                pass  # the agent killed it (after its shutdown grace period)
    assert rc == 0, text[-4000:]
    named = [
        line
        for line in text.splitlines()
        if f"rank {stopped['rank']} (" in line and "watchdog" in line
    ]
    assert named and "sent no heartbeat" in named[0], text[-4000:]
    assert_matches_reference(text, reference)
    (rec,) = recovery_times(text)
    assert rec["restart"] == 1 and rec["silent_rank"] == stopped["rank"], rec
    assert rec["resumed"] in (8, 12) and rec["repeated"] >= 0, rec
    assert timeout <= rec["seconds"] < 120, rec  # detection alone takes the heartbeat timeout
    print(f"\nSIGSTOP of rank {stopped['rank']}: {named[0].strip()}\n{rec}")
