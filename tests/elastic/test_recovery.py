"""Recovery path: `kill -9` of one of 4 workers under torchrun; the job restarts from the newest
complete in-memory snapshot and trains exactly like an uninterrupted run."""

import os
import re
import signal
import subprocess
import time

from recovery_helpers import (  # noqa: E402
    REPO,
    Progress,
    args,
    assert_matches_reference,
    recovery_times,
    torchrun_cmd,
    workers_of,
)

from megadyn.testing import free_port, run_pretrain, spawn


def test_two_kills_in_a_row_recover_from_snapshots(tmp_path):
    iters, interval = 40, 4
    reference = spawn(run_pretrain, world=1, args=(args(iters),))[0].history
    cmd = torchrun_cmd(
        [
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
        ],
        nproc=4,
        endpoint=f"127.0.0.1:{free_port()}",
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    job = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    log, kills, starts, progress = [], [], 0, Progress()
    deadline = time.monotonic() + 300
    for line in job.stdout:
        log.append(line)
        starts += " megadyn: 4 processes" in line
        if progress.read(line) and kills and len(kills[-1]) == 3 and starts > len(kills):
            kills[-1].append(time.monotonic())  # the first step after a restart
        # kill a worker after iteration 10 once snapshot 8 is complete, and again once the
        # restarted job passed iteration 20 and completed snapshot 16
        after, snap = (10, 8) if not kills else (20, 16)
        if len(kills) < 2 and progress.past(after, snap) and starts == len(kills) + 1:
            os.kill(sorted(workers_of(job.pid))[1 + len(kills)], signal.SIGKILL)
            kills.append([progress.iteration, time.monotonic(), progress.snapshot])
        if time.monotonic() > deadline:
            job.kill()
            break
    assert job.wait(timeout=60) == 0, "".join(log[-40:])
    text = "".join(log)
    resumed = [
        int(x)
        for x in re.findall(r"recovery: resuming from the in-memory snapshot .*iter_(\d+)", text)
    ]
    assert len(resumed) == 2 and len(kills) == 2, text[-3000:]
    for (last_before, _, newest, *_), snap in zip(kills, resumed):
        assert snap >= newest  # the newest snapshot complete before the kill, or a newer one
        assert last_before - snap <= interval + 1  # the lost work is at most a snapshot interval
    assert_matches_reference(text, reference)
    logged = recovery_times(text)  # the job's own line, timed from the last heartbeat
    lines = [line for line in text.splitlines() if "recovery: restart" in line]
    for line in lines:  # where each restart went, phase by phase
        phases = ("process started", "python and imports", "snapshot located", "first step")
        assert all(phase in line for phase in phases), line
    assert [r["restart"] for r in logged] == [1, 2] and [r["resumed"] for r in logged] == resumed
    for (last_before, killed, _, back), snap, rec in zip(kills, resumed, logged):
        # the kill races with the step after the one the test saw logged
        assert abs(rec["repeated"] - (last_before - snap)) <= 1 and rec["seconds"] < 60, rec
        print(
            f"recovery: killed after iteration {last_before}, resumed from snapshot {snap}, "
            f"kill to next completed step {back - killed:.1f} s; the job logged "
            f"{rec['seconds']:.1f} s from the last heartbeat of rank {rec['silent_rank']}"
        )


def test_without_a_snapshot_the_disk_checkpoint_is_used_and_said(tmp_path, capfd):
    save = str(tmp_path / "ckpt")
    spawn(run_pretrain, world=1, args=(args(6) + ["--save", save, "--save-interval", "3"],))
    capfd.readouterr()
    resumed = spawn(
        run_pretrain,
        world=1,
        args=(
            args(6)
            + [
                "--load",
                save,
                "--elastic-snapshot-interval",
                "2",
                "--elastic-snapshot-dir",
                str(tmp_path / "none"),
            ],
        ),
    )[0]
    out = capfd.readouterr().out
    assert "no complete in-memory snapshot; falling back to the disk checkpoint" in out
    assert resumed.losses == {}  # the disk checkpoint was at the end: nothing left to train
