"""Shared pieces of megadyn's recovery-path tests (torchrun restarts from in-memory snapshots).

cmd = torchrun_cmd(["pretrain_gpt.py", *args(40)], nproc=4, endpoint=f"127.0.0.1:{port}")
codes, text = run_torchrun([cmd], on_line)  # on_line(line, agents) may kill workers:
os.kill(sorted(workers_of(agents[0].pid))[1], signal.SIGKILL)   # one worker of that agent
assert_matches_reference(text, reference)   # every step logged, with the reference's loss
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from test_live_reconfiguration import LIVE

from tests.tiny import REPEATABLE, RUN, tiny_args

REPO = Path(__file__).resolve().parents[2]
SNAPSHOT_DONE = re.compile(r"in-memory snapshot \S*iter_(\d+) complete")
"""The line the logging rank prints when a snapshot became complete (all its pieces written)."""


class Progress:
    """What a job's log said so far: the last iteration logged and the newest complete
    snapshot. `read(line)` is True when the line is an iteration line."""

    def __init__(self) -> None:
        self.iteration = self.snapshot = 0

    def read(self, line: str) -> bool:
        done = SNAPSHOT_DONE.search(line)
        if done:
            self.snapshot = max(self.snapshot, int(done.group(1)))
        m = LINE.search(line)
        if m:
            self.iteration = int(m.group(1))
        return m is not None

    def past(self, iteration: int, snapshot: int) -> bool:
        """Iteration `iteration` is logged and snapshot `snapshot` (or a newer one) complete."""
        return self.iteration >= iteration and self.snapshot >= snapshot


LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|")


IN_PROCESS = {
    **RUN,
    **REPEATABLE,
    "num_layers": 4,
    "make_vocab_size_divisible_by": 8,
    "global_batch_size": 12,
    "lr_decay_style": "constant",
}
"""The job of the in-process recovery and drain tests (they add --train-iters): 4 layers, 12
samples a step, a constant learning rate."""


def args(iters: int) -> list[str]:
    """The tiny model of the live-reconfiguration tests, trained for `iters` steps."""
    return tiny_args(LIVE, train_iters=iters, lr="1e-3", min_lr="1e-4")


def workers_of(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (a torchrun agent's workers)."""
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


def torchrun_cmd(
    script_and_args: list[str],
    *,
    nproc: int,
    endpoint: str,
    nnodes: int | str = 1,
    max_restarts: int = 2,
    run_id: str = "recovery-test",
    rdzv_conf: str | None = None,
) -> list[str]:
    """A torchrun command line with c10d rendezvous at `endpoint` (one agent per node);
    `nnodes` may be a range ("1:2"), `rdzv_conf` torchrun's --rdzv-conf."""
    conf = ["--rdzv-conf", rdzv_conf] if rdzv_conf else []
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        *conf,
        *script_and_args,
    ]


def losses_by_iteration(text: str) -> dict[int, float]:
    """Per-step lm loss from iteration log lines; a step run again after a restart overwrites
    the first value."""
    return {int(it): float(loss) for it, loss in LINE.findall(text)}


def assert_matches_reference(text: str, reference: list[float], rtol: float = 1e-5) -> None:
    """Every iteration 1..len(reference) was logged (none lost) with the reference's loss."""
    losses = losses_by_iteration(text)
    assert sorted(losses) == list(range(1, len(reference) + 1)), text[-3000:]
    for i, want in enumerate(reference, start=1):
        assert abs(losses[i] - want) <= rtol * abs(want), (i, losses[i], want)


RECOVERY = re.compile(
    r"recovery: restart (\d+) \| resumed from iteration (\d+) \| iterations repeated: (\d+)"
    r".*?: ([0-9.]+) s, measured from the last heartbeat of rank (\d+)"
)
"""The line a restarted job logs at its first completed step (megadyn/launch/watchdog.py)."""


def recovery_times(text: str) -> list[dict]:
    """Each restart's recovery line: restart, resumed iteration, repeated steps, seconds, rank."""
    keys = ("restart", "resumed", "repeated", "seconds", "silent_rank")
    return [
        dict(zip(keys, (int(a), int(b), int(c), float(d), int(e))))
        for a, b, c, d, e in RECOVERY.findall(text)
    ]


def rank_of(pid: int) -> int:
    """The global RANK torchrun gave worker `pid`."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env[b"RANK"])


def run_torchrun(cmds, on_line=None, *, env=None, stagger_s=1.0, deadline_s=240):
    """Start one torchrun agent per command (one per simulated host, `stagger_s` apart) and wait
    for all of them; `on_line(line, agents)` sees every output line as it comes. Returns the
    agents' exit codes and the merged output. Every agent and worker is killed at the end."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    read, write = os.pipe()
    agents = []

    def kill_all():
        for agent in agents:
            for pid in workers_of(agent.pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            agent.kill()

    timer = threading.Timer(deadline_s, kill_all)
    timer.start()
    try:
        for i, cmd in enumerate(cmds):
            time.sleep(stagger_s if i else 0)
            agents.append(
                subprocess.Popen(cmd, cwd=REPO, env=env, stdout=write, stderr=subprocess.STDOUT)
            )
        os.close(write)
        log = []
        with os.fdopen(read) as stream:
            for line in stream:  # ends once every agent and worker closed its output
                log.append(line)
                if on_line is not None:
                    on_line(line, agents)
        return [agent.wait(timeout=60) for agent in agents], "".join(log)
    finally:
        timer.cancel()
        kill_all()
