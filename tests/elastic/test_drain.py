"""SIGTERM drains a worker as a live scale-in (elastic mode, --elastic-recovery in-process).

One torchrun job of 5 processes, 3 members at dp 3 and 2 standby processes, gets four SIGTERMs
in turn, each sent once the job logged the previous one's outcome:

    rank 4 (standby)        it leaves the live set and exits 0; the layout stays
    rank 1 (member)         standby rank 3 takes its place in the same layout (dp 3)
    rank 2 (member)         no standby left: the layout planner's layout for 2 members
    rank 0 (leader, hosts   refused with one line; --exit-signal-handler: every member saves a
      the control store)    checkpoint at that step boundary and the job exits 0

Every loss equals an uninterrupted run's, and every sample is drawn once.
"""

import json
import os
import re
import signal
import sys
from collections import Counter
from pathlib import Path

from recovery_helpers import IN_PROCESS, LINE, rank_of, run_torchrun, workers_of

from megadyn.testing import free_port, run_pretrain, spawn
from tests.tiny import tiny_args

TINY = tiny_args(IN_PROCESS, use_distributed_optimizer=True)
DRAIN = re.compile(
    r"elastic: event: drain \| epoch: \d+ \| iteration: \d+ \| old: (\S+) \| new: (\S+) \| left: (\d+)"
)
REFUSED = re.compile(r"elastic: drain of rank 0 refused: rank 0 hosts the control store")
SIGTERMS = [4, 1, 2, 0]  # the rank that gets the next SIGTERM, in turn


def test_sigterm_drains_members_and_standby_processes(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    port, master = free_port(), free_port()
    argv = ["tests/elastic/drain_worker.py", *TINY, "--train-iters", "2000",
            "--elastic-initial-members", "3", "--elastic-control-port", str(port),
            "--exit-signal-handler", "--save", str(tmp_path / "ckpt"), "--save-interval", "10000"]  # fmt: skip
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "5"),
        *("--master-port", str(master), *argv),
    ]
    sent, seen = [], {"iteration": 0, "drains": 0}

    def on_line(line, agents):
        m = LINE.search(line)
        seen["iteration"] = int(m.group(1)) if m else seen["iteration"]
        seen["drains"] += bool(DRAIN.search(line))
        # the next SIGTERM once the previous drain is logged and two more steps ran
        if len(sent) < len(SIGTERMS) and len(sent) == seen["drains"] and seen["iteration"] > 2:
            rank = SIGTERMS[len(sent)]
            pid = next(p for p in workers_of(agents[0].pid) if rank_of(p) == rank)
            os.kill(pid, signal.SIGTERM)
            sent.append((rank, seen["iteration"]))

    env = {"DRAIN_TEST_OUT": str(out), "PYTHONPATH": str(Path(__file__).parents[2])}
    (code,), log = run_torchrun([cmd], on_line, env=env, deadline_s=150)
    print(log)
    assert code == 0, log[-3000:]
    assert [r for r, _ in sent] == SIGTERMS, sent
    drains = DRAIN.findall(log)
    assert drains[:2] == [
        ("tp1xpp1xdp3", "tp1xpp1xdp3", "4"),  # standby 4 left the live set
        ("tp1xpp1xdp3", "tp1xpp1xdp3", "1"),  # standby 3 took rank 1's place
    ], drains
    assert len(drains) == 3 and drains[2][0] == "tp1xpp1xdp3" and drains[2][2] == "2", drains
    assert drains[2][1] != "tp1xpp1xdp3"  # the layout planner's choice for 2 members
    assert REFUSED.search(log) and "every member saves a checkpoint" in log, log[-3000:]

    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(results) == [0, 1, 2, 3, 4], sorted(results)  # every process ended normally
    assert {r["megadyn"] for r in results.values()} == {
        str(Path(__file__).parents[2] / "megadyn" / "__init__.py")
    }
    losses = {}
    for r in results.values():
        losses.update({int(k): v for k, v in r["losses"].items()})
    last = max(losses)
    assert sorted(losses) == list(range(1, last + 1))
    assert (tmp_path / "ckpt" / f"iter_{last:07d}").is_dir()  # saved where the job stopped
    reference = spawn(run_pretrain, world=1, args=(TINY + ["--train-iters", str(last)],))[0].history
    for i, want in enumerate(reference, start=1):
        assert abs(losses[i] - want) <= 1e-5 * abs(want), (i, losses[i], want)
    drawn = Counter(s for r in results.values() for s in r["samples"])
    assert sorted(drawn) == list(range(12 * last)) and set(drawn.values()) == {1}


def sigterm_at(rank: int, iteration: int):
    """An on_line callback for run_torchrun: SIGTERM to `rank` once `iteration` is logged."""
    sent = []

    def on_line(line, agents):
        m = LINE.search(line)
        if not sent and m and int(m.group(1)) >= iteration:
            pid = next(p for p in workers_of(agents[0].pid) if rank_of(p) == rank)
            os.kill(pid, signal.SIGTERM)
            sent.append(int(m.group(1)))

    return on_line, sent


def two_workers(*flags: str) -> list[str]:
    master = free_port()
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(master), "pretrain_gpt.py", *TINY, "--train-iters", "2000",
            *flags]  # fmt: skip


def test_a_drain_below_min_members_ends_the_worker_as_sigterm_does():
    # dp 2 with --elastic-min-members 2: rank 1 cannot leave; without --exit-signal-handler
    # SIGTERM ends it after all (one line says so), and the job stops (no --max-restarts)
    cmd = two_workers("--elastic-control-port", str(free_port()), "--elastic-min-members", "2")
    on_line, sent = sigterm_at(1, 3)
    (code,), log = run_torchrun([cmd], on_line, deadline_s=90)
    print(log)
    assert sent and code != 0, log[-3000:]
    assert (
        "elastic: drain of rank 1 refused: 1 members is below --elastic-min-members (2); "
        "SIGTERM ends rank 1 (no --exit-signal-handler)" in log
    ), log[-3000:]
    assert "exitcode  : -15" in log and "Signal 15 (SIGTERM) received by PID" in log, log[-3000:]


def test_exit_signal_handler_without_elastic_mode_saves_and_exits(tmp_path):
    # Megatron-LM's --exit-signal-handler: the processes agree on the SIGTERM at the step
    # boundary, save a checkpoint there and exit 0
    ckpt = tmp_path / "ckpt"
    cmd = two_workers("--exit-signal-handler", "--save", str(ckpt), "--save-interval", "10000")
    on_line, sent = sigterm_at(1, 3)
    (code,), log = run_torchrun([cmd], on_line, deadline_s=90)
    print(log)
    assert sent and code == 0, log[-3000:]
    stop = re.search(r"SIGTERM received; saving a checkpoint and exiting at iteration (\d+)", log)
    assert stop, log[-3000:]
    assert (ckpt / f"iter_{int(stop.group(1)):07d}").is_dir()
    assert int(stop.group(1)) < 2000
