"""Restart path under torchrun beyond a plain `kill -9`: a hung (stopped) worker is named by the
heartbeats and the job restarts; a worker killed during a live reshard (elastic mode); a lost
host, after which the survivors continue on a layout planned for their number. Each restarted
job logs its recovery time, and trains exactly like an uninterrupted run."""

import json
import os
import signal
import threading
import time

import torch.distributed as dist
from recovery_helpers import (
    Progress,  # noqa: E402
    args,
    assert_matches_reference,
    rank_of,
    recovery_times,
    run_torchrun,
    torchrun_cmd,
    workers_of,
)

from megadyn.launch.distributed_init import attempt_prefix
from megadyn.launch.watchdog import Watchdog, read_previous_attempt
from megadyn.testing import free_port, run_pretrain, spawn

TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def test_the_previous_attempt_is_read_from_its_heartbeats():
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    beats = dist.PrefixStore(attempt_prefix(0) + "heartbeat/", store)
    beats.set("world", "3")  # rank 2 died before its first heartbeat
    for rank, t, it in ((0, 105.0, 11), (1, 100.0, 10)):
        beat = dict(time=t, iteration=it, host="h", pid=1, done=False)
        beats.set(str(rank), json.dumps(beat))
    beats.set("progress", "12")
    prev = read_previous_attempt(store, 0)
    assert (prev.silent_rank, prev.last_heartbeat, prev.iteration) == (1, 100.0, 12)
    assert read_previous_attempt(store, 1) is None
    line = Watchdog(store, rank=0, world=3, timeout=5, restart=1).recovery_line(9, prev)
    (rec,) = recovery_times(line)
    assert rec["resumed"] == 8 and rec["repeated"] == 4 and rec["silent_rank"] == 1, line


def test_a_stopped_worker_is_named_and_the_job_restarts(tmp_path):
    iters, timeout = 24, 5
    reference = spawn(run_pretrain, world=1, args=(args(iters),))[0].history
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
            "--no-elastic-fork-server",  # the restarted workers import as a fresh process
        ],
        nproc=4,
        endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=1,
    )
    stopped, progress = {}, Progress()

    def on_line(line, agents):
        # hang a worker (SIGSTOP, not a kill) after step 10, once snapshot 8 is complete
        if progress.read(line) and progress.past(10, 8) and not stopped:
            pid = sorted(workers_of(agents[0].pid))[1]
            stopped.update(pid=pid, rank=rank_of(pid), at=time.monotonic())
            os.kill(pid, signal.SIGSTOP)

    try:
        (rc,), text = run_torchrun([cmd], on_line)
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
    assert "fork server" not in text, text[-4000:]
    print(f"\nSIGSTOP of rank {stopped['rank']}: {named[0].strip()}\n{rec}")


def test_elastic_mode_resumes_after_a_kill_during_a_live_reshard(tmp_path):
    iters, port = 20, free_port()
    reference = spawn(run_pretrain, world=1, args=(args(iters),))[0].history
    cmd = torchrun_cmd(
        [
            "tests/elastic/kill_mid_reshard.py",
            *args(iters),
            *TP2_PP2,
            "--elastic-control-port",
            str(port),
            "--elastic-snapshot-interval",
            "4",
            "--elastic-snapshot-dir",
            str(tmp_path / "shm"),
        ],
        nproc=4,
        endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=1,
    )
    request = {"action": "layout", "tp": 1, "pp": 2, "members": 4, "at_iteration": 10}
    submitted = threading.Thread(target=submit, args=(port, request), daemon=True)
    submitted.start()
    (rc,), text = run_torchrun([cmd], env={"KILL_RANK": "1"})
    assert rc == 0, text[-4000:]
    assert " test: rank 1 killed during the reshard" in text, text[-4000:]
    # the snapshot of iteration 8 is the newest complete one; the reshard at 10 never finished
    assert "resuming from the in-memory snapshot" in text and "iter_0000008" in text, text[-4000:]
    assert_matches_reference(text, reference)
    (rec,) = recovery_times(text)
    assert rec["restart"] == 1 and rec["resumed"] == 8 and rec["repeated"] == 2, rec
    print(f"\nkill during a live reshard: {rec}")


def submit(port: int, request: dict) -> None:
    """An operator request to the job's control store (waits for the store to come up)."""
    from megadyn.elastic.control.channel import ControlChannel, connect

    ControlChannel(connect("127.0.0.1", port, is_server=False, timeout_s=120)).submit(request)


def group_rank_of(agent_pid: int) -> int:
    """GROUP_RANK (node rank) that torchrun gave the workers of agent `agent_pid`."""
    (pid, *_) = workers_of(agent_pid)
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env[b"GROUP_RANK"])


def test_a_lost_host_leaves_two_workers_on_a_new_layout(tmp_path):
    # two simulated hosts: two torchrun agents of 2 workers each under --nnodes 1:2, one c10d
    # endpoint; the first agent hosts the rendezvous store (is_host) and is node rank 0
    iters = 24
    reference = spawn(run_pretrain, world=1, args=(args(iters),))[0].history
    endpoint = f"127.0.0.1:{free_port()}"
    script = [
        "pretrain_gpt.py",
        *args(iters),
        *TP2_PP2,
        "--elastic-snapshot-interval",
        "4",
        "--elastic-snapshot-dir",
        str(tmp_path / "shm"),
    ]
    # a lost host counts as gone after keep_alive_interval x keep_alive_max_attempt seconds
    conf = "join_timeout=60,last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3,is_host="
    cmds = [
        torchrun_cmd(script, nproc=2, endpoint=endpoint, nnodes="1:2", rdzv_conf=conf + h)
        for h in ("1", "0")
    ]
    lost, progress = {}, Progress()

    def on_line(line, agents):
        # the second host goes away after step 10, once snapshot 8 is complete
        if progress.read(line) and progress.past(10, 8) and not lost:
            lost["group_rank"] = group_rank_of(agents[1].pid)
            for pid in workers_of(agents[1].pid):
                os.kill(pid, signal.SIGKILL)
            agents[1].kill()

    (survivor, gone), text = run_torchrun(cmds, on_line)
    assert survivor == 0 and gone == -signal.SIGKILL, text[-4000:]
    assert lost["group_rank"] == 1, "the agent started second must be node rank 1"
    assert " megadyn: 4 processes, layout tp=2 pp=2 dp=1" in text, text[-4000:]
    assert "the restart came back with 2 processes" in text, text[-4000:]
    assert " megadyn: 2 processes, layout tp=1 pp=2" in text, text[-4000:]
    assert_matches_reference(text, reference)  # no iteration missing, the same losses
    (rec,) = recovery_times(text)
    assert rec["restart"] == 1 and rec["resumed"] in (8, 12), rec
    print(f"\nlost host, 4 -> 2 workers: {rec}")
