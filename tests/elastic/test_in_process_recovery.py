"""The survivors of a killed or hung worker recover in-process (megadyn/elastic/recovery/recovery.py).

Real `python -m megadyn.launch --max-restarts 0` jobs of pretrain_gpt.py (through
tests/elastic/recover_worker.py, which records each step's samples) on gloo, elastic mode:

    5 processes, tp2 x dp2 and one standby   kill -9 of rank 1: the standby process takes its
                                             place in the same layout; then SIGSTOP of rank 2:
                                             its watchers kill it after the heartbeat timeout
                                             and the 3 survivors train under the planner's
                                             3-process layout
    2 processes, dp2                         kill -9 of rank 0 (it hosts the control store):
                                             dp 1 from rank 1's replica; rank 1 hosts the
                                             control store anew
    2 processes, dp2, distributed optimizer  kill -9 of rank 1: with 2 optimizer instances its
                                             shard has a replica on rank 0; with 1 it has none
                                             and the survivor loads the newest in-memory
                                             snapshot, in the same process; with no snapshot
                                             it says why and exits (the restart path)
    3 processes, dp3                         kill -9 of rank 1; rank 2 dies while the first
                                             failure is handled (as the survivors create their
                                             groups): the last one goes on at once

Each job exits 0 after training to the end; every logged loss equals an uninterrupted run's
within 1e-5 (an interrupted step is logged twice, each time with the same loss), and every
sample of every iteration is drawn once by the replicas that finished it last.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
from recovery_helpers import IN_PROCESS, LINE, REPO, rank_of, run_torchrun, workers_of

from megadyn.testing import free_port, run_pretrain, spawn
from tests.tiny import tiny_args

TINY = tiny_args(IN_PROCESS)
ITERS = 14
GBS = 12
RECOVERED = re.compile(
    r"elastic: epoch: \d+ \| event: failure \| iteration: (\d+) \| old: (\S+) \| new: (\S+) \| "
    r"left: ([\d,]+) \| repeated: (\d+) \| from: ([a-z -]+) \|.* first_step_s: ([\d.]+) \| "
    r"total_s: ([\d.]+)"
)


@pytest.fixture(scope="module")
def reference():
    return spawn(run_pretrain, world=1, args=(TINY + ["--train-iters", str(ITERS)],))[0].history


def recorded(out: Path, rank: int, iteration: int) -> bool:
    """Whether `rank`'s record (recover_worker.py) shows `iteration` or a later one."""
    path = out / f"rank{rank}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return any(json.loads(line)["it"] >= iteration for line in lines if line.endswith("}"))


def await_records(out: Path, ranks, iteration: int, timeout_s: float = 10.0) -> None:
    """Wait (up to `timeout_s`) until every rank's record shows `iteration`: a signal sent on
    the log line alone could land in a victim's step after its collectives but before its
    record, which would then miss that step's samples."""
    deadline = time.monotonic() + timeout_s
    while not all(recorded(out, r, iteration) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.005)


def job(tmp_path, nproc: int, flags: list[str], signals: list[tuple[int, int, str]],
        env: dict | None = None, control_port: int | None = None):  # fmt: skip
    """Run one job; `signals`: (rank, at iteration, signal name) sent in turn, each once the
    log shows that iteration and every earlier signal's recovery, and the rank's own record
    shows it (sent at once on the log line, the signal could land in the victim's last step
    after its collectives but before its record, which would then miss that step's samples);
    `env`: more environment for the workers (recover_worker.py); `control_port`: the job's
    --elastic-control-port (default: a free one)."""
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "megadyn.launch", "--nproc-per-node", str(nproc),
           "--max-restarts", "0", "--master-port", str(free_port()),
           "tests/elastic/recover_worker.py", *TINY, "--train-iters", str(ITERS),
           "--elastic-control-port", str(control_port or free_port()), *flags]  # fmt: skip
    state = {"iteration": 0, "recoveries": 0, "sent": [], "next": 0}

    def send(agents, rank: int, iteration: int, name: str) -> None:
        await_records(out, [rank], iteration)
        pid = next(p for p in workers_of(agents[0].pid) if rank_of(p) == rank)
        os.kill(pid, getattr(signal, name))
        state["sent"].append((rank, name, state["iteration"]))

    def on_line(line, agents):
        m = LINE.search(line)
        state["iteration"] = int(m.group(1)) if m else state["iteration"]
        state["recoveries"] += bool(RECOVERED.search(line))
        n = state["next"]
        if n < len(signals) and state["recoveries"] >= n and state["iteration"] >= signals[n][1]:
            threading.Thread(target=send, args=(agents, *signals[n])).start()
            state["next"] += 1

    env = {
        "RECOVER_TEST_OUT": str(out),
        "PYTHONPATH": str(Path(__file__).parents[2]),
        **(env or {}),
    }
    (code,), log = run_torchrun([cmd], on_line, env=env, deadline_s=150)
    print(log)
    assert len(state["sent"]) == len(signals), state
    return code, log, out


def job_with_request(tmp_path, nproc, flags, request, signals, env=None):
    """`job` with `tools/elastic_ctl.py <request>` started beside it (the leader's first step
    boundary waits until it is queued); also the tool's output and process."""
    port = free_port()
    tool = subprocess.Popen(
        [sys.executable, "tools/elastic_ctl.py", "--port", str(port), "--timeout", "120",
         *request],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    env = {"RECOVER_TEST_AWAIT_REQUEST": "1", **(env or {})}
    try:
        code, log, out = job(tmp_path, nproc, flags, signals, env, control_port=port)
        answer = tool.communicate(timeout=60)[0]
    finally:
        tool.kill()
    return code, log, out, answer, tool


def check_losses(log: str, reference: list[float], most_repeated: int = 1) -> None:
    """Every logged loss matches the uninterrupted run; every iteration is logged, at most
    `most_repeated` of them more than once."""
    logged = defaultdict(list)
    for it, loss in LINE.findall(log):
        logged[int(it)].append(float(loss))
    assert sorted(logged) == list(range(1, ITERS + 1)), sorted(logged)
    for it, losses in logged.items():
        for loss in losses:
            want = reference[it - 1]
            assert abs(loss - want) <= 1e-5 * abs(want), (it, loss, want)
    assert sum(len(v) > 1 for v in logged.values()) <= most_repeated, dict(logged)


def check_samples(out: Path) -> None:
    """For each iteration, the replicas that ran it last drew each of its samples once."""
    runs = defaultdict(list)  # iteration -> (time, members, samples) of every replica's step
    for path in out.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            step = json.loads(line)
            runs[step["it"]].append((step["t"], step["members"], step["samples"]))
    assert sorted(runs) == list(range(1, ITERS + 1)), sorted(runs)
    for it, steps in runs.items():
        last = max(steps)[1]  # a step run again after a recovery ran under other members
        drawn = sorted(i for _, members, samples in steps if members == last for i in samples)
        assert drawn == list(range(GBS * (it - 1), GBS * it)), (it, drawn)


def recoveries(log: str) -> list[tuple]:
    return RECOVERED.findall(log)


def test_standby_replacement_then_a_hung_worker(tmp_path, reference):
    flags = ["--tensor-model-parallel-size", "2", "--elastic-initial-members", "4",
             "--elastic-heartbeat-timeout", "3"]  # fmt: skip
    code, log, out = job(tmp_path, 5, flags, [(1, 3, "SIGKILL"), (2, 7, "SIGSTOP")])
    assert code == 0, log[-3000:]
    (first, second) = recoveries(log)
    assert first[1:4] == ("tp2xpp1xdp2", "tp2xpp1xdp2", "1") and first[5] == "replicas"
    assert second[1] == "tp2xpp1xdp2" and second[3] == "2" and second[5] == "replicas"
    tp, pp, dp = map(int, re.match(r"tp(\d+)xpp(\d+)xdp(\d+)", second[2]).groups())
    assert tp * pp * dp == 3, second  # the planner's layout for the 3 survivors
    assert "sent no heartbeat" in log and "killed it (same host)" in log, log[-3000:]
    check_losses(log, reference, most_repeated=2)
    check_samples(out)


@pytest.mark.parametrize(
    "flags, victim",
    [
        ([], 0),  # rank 0, which hosts the control store
        (["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"], 1),
    ],
    ids=["replicated-weights-rank0", "replicated-optimizer-shards"],
)
def test_dp2_to_dp1_from_the_replica(tmp_path, reference, flags, victim):
    # the control store's host dies with a request queued (never due): the waiting tool
    # says in one line that the store went away
    scale = ["scale", "1", "--at-iteration", "1000"]
    code, log, out, answer, tool = job_with_request(
        tmp_path, 2, flags, scale, [(victim, 4, "SIGKILL")]
    )
    assert code == 0, log[-3000:]
    if victim == 0:
        assert tool.returncode == 1 and answer.splitlines()[-1].startswith(
            "the job's control store on 127.0.0.1:"
        ), answer
        assert len(answer.splitlines()) == 2 and "frame #" not in answer, answer
    else:  # the job finished first
        assert "finished at iteration 14" in answer, answer
    ((it, old, new, left, repeated, source, *_),) = recoveries(log)
    assert (old.split("+")[0], new, left, source) == (
        "tp1xpp1xdp2",
        "tp1xpp1xdp1",
        str(victim),
        "replicas",
    )
    if victim == 0:
        assert "elastic: rank 1 (" in log and "now hosts the control store" in log, log[-3000:]
    check_losses(log, reference)
    check_samples(out)


def test_no_replica_of_an_optimizer_shard_falls_back_to_the_snapshot(tmp_path, reference):
    flags = ["--use-distributed-optimizer", "--elastic-snapshot-interval", "3",
             "--elastic-snapshot-dir", str(tmp_path / "snapshots")]  # fmt: skip
    code, log, out = job(tmp_path, 2, flags, [(1, 8, "SIGKILL")])
    assert code == 0, log[-3000:]
    ((it, old, new, left, repeated, source, *_),) = recoveries(log)
    assert (old, new, left, source) == ("tp1xpp1xdp2", "tp1xpp1xdp1", "1", "in-memory snapshot")
    assert "recovery: resuming from the in-memory snapshot" in log, log[-3000:]
    check_losses(log, reference, most_repeated=ITERS)
    check_samples(out)


def test_a_second_failure_while_the_first_is_handled(tmp_path, reference):
    # rank 1 is killed; rank 2 kills itself inside the survivors' recovery, as they create the
    # new layout's groups, where rank 0 waits for its address in the store: that wait ends
    # when rank 2's failure is recorded (it used to last the 60 s connect timeout), and rank 0
    # agrees again with both failures and trains on alone
    in_recovery = {"RECOVER_TEST_IN_RECOVERY": "2:SIGKILL:1"}
    code, log, out = job(tmp_path, 3, ["--elastic-heartbeat-timeout", "10"],
                         [(1, 4, "SIGKILL")], env=in_recovery)  # fmt: skip
    assert code == 0, log[-3000:]
    assert "rank 2 (local rank 2 on" in log, log[-3000:]  # the agent saw it die
    ((it, old, new, left, repeated, source, first_step_s, total_s),) = recoveries(log)
    assert (old, new, left, source) == ("tp1xpp1xdp3", "tp1xpp1xdp1", "1,2", "replicas")
    assert float(total_s) < 30, total_s  # no wait of the recovery ran to its timeout
    check_losses(log, reference)
    check_samples(out)


def test_a_request_whose_reconfiguration_a_failure_cut_short(tmp_path, reference):
    # an operator's layout request is taken at iteration 5; rank 1 dies as the reconfiguration
    # starts building the new layout. The survivors (rank 0 keeps the control store) recover,
    # and the request, never answered, is applied after the recovery: tp2 over ranks 0 and 2
    env = {"RECOVER_TEST_IN_RECONFIGURATION": "1:SIGKILL"}
    request = ["layout", "--tp", "2", "--pp", "1", "--members", "2", "--at-iteration", "5"]
    code, log, out, answer, tool = job_with_request(tmp_path, 3, [], request, [], env)
    assert code == 0, log[-3000:]
    assert tool.returncode == 0 and '"status": "done"' in answer, answer
    assert "Traceback" not in answer and "frame #" not in answer, answer
    ((it, old, new, left, *_),) = recoveries(log)
    assert (old, left) == ("tp1xpp1xdp3", "1"), log[-3000:]  # new: the planner's for 2
    assert "request 0 was cut short by the failure; it is applied again" in log, log[-3000:]
    assert re.search(rf"event: layout \| epoch: \d+ \| iteration: \d+ \| old: {re.escape(new)} "
                     r"\| new: tp2xpp1xdp1", log), log[-3000:]  # fmt: skip
    check_losses(log, reference)
    check_samples(out)


def test_no_replica_and_no_snapshot_take_the_restart_path(tmp_path):
    # the dead rank's optimizer shard is nowhere else and no snapshot was taken: one line says
    # so (the first of the two survivors to claim it in the agent's store), the survivors exit
    # and torchrun's path follows (no restarts left: the job fails)
    code, log, _ = job(tmp_path, 3, ["--use-distributed-optimizer"], [(1, 4, "SIGKILL")])
    assert code != 0, log[-3000:]
    line = "elastic: the survivors of rank(s) [1] cannot recover in-process: no survivor holds a replica"
    assert log.count(line) == 1, log[-3000:]
    assert "and no in-memory snapshot to load; exiting so that torchrun's restart path runs" in log
    # which survivor's exit the agent sees first is a race: either one names the other
    failed = [ln for ln in log.splitlines() if "megadyn.launch: the survivors failed too" in ln]
    assert failed and all(f"rank {r} (local rank {r}" in failed[0] for r in (0, 2)), log[-3000:]
