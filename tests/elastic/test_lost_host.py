"""A lost host is a live reconfiguration: the survivors on the other hosts train on, in the
same processes (megadyn/launch/hosts.py, coordinator.py).

Two simulated hosts (two `python -m megadyn.launch` agents of 2 workers each, MEGADYN_HOST a
and b) rendezvous through `python -m megadyn.launch.coordinator`, a third process; tp 2 x dp 2,
so each host holds one whole data-parallel replica. A whole host is lost: its agent and its
workers are SIGKILLed together. For the host of rank 0 (node rank 0: rank 0 hosts the control
store and leads) and for the other one, with --max-restarts 0:
- the job exits 0 (the survivors' agent), the lost host's agent was killed;
- the surviving agent declared the host lost in one line, and the survivors recovered in-process
  from their own replica;
- every loss equals an uninterrupted run's within 1e-5 (at most the interrupted step twice) and
  every sample was drawn once;
- the log stays short: no warning per failed send to the lost host.
Then a worker on host b stopped with SIGSTOP: its watchers on host a cannot kill it (another
host), so they ask its agent through the store; the agent (or its neighbour on host b, whichever
notices first) kills it and the survivors recover.
And host b lost while a live layout change (an operator's request) is in flight: rank 2 stops
itself as the change starts building the new layout, and the test then kills host b whole.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from recovery_helpers import LINE, REPO, run_torchrun, workers_of
from test_in_process_recovery import (
    ITERS,
    TINY,
    await_records,
    check_losses,
    check_samples,
    recoveries,
    reference,  # noqa: F401 - the module's fixture
)
from test_restarts import group_rank_of

from megadyn.testing import free_port

TP2 = ["--tensor-model-parallel-size", "2"]


def coordinator(port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megadyn.launch.coordinator", "--host", "127.0.0.1"]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert "megadyn coordinator: serving on 127.0.0.1:" in proc.stdout.readline()
    return proc


def two_hosts(tmp_path, flags: list[str], on_line, env=None, control_port=None, port=None):
    """Run the job on hosts a and b through a coordinator (started here, unless the caller
    serves one on `port`); returns the agents' exit codes (in the order a, b), the log and the
    workers' record directory. `env`: more environment for the workers (recover_worker.py)."""
    out = tmp_path / "out"
    out.mkdir()
    server = None if port else coordinator(port := free_port())
    launch = [sys.executable, "-m", "megadyn.launch", "--nnodes", "2", "--nproc-per-node", "2",
              "--max-restarts", "0", "--coordinator", f"127.0.0.1:{port}",
              "--rdzv-id", "lost-host", "--host-timeout", "2", "--monitor-interval", "0.1",
              "tests/elastic/recover_worker.py", *TINY, "--train-iters", str(ITERS),
              "--elastic-control-port", str(control_port or free_port()), *TP2, *flags]  # fmt: skip
    cmds = [["env", f"MEGADYN_HOST={host}", *launch] for host in "ab"]  # env execs: same pid
    env = {"RECOVER_TEST_OUT": str(out), "PYTHONPATH": str(REPO), **(env or {})}
    try:
        codes, log = run_torchrun(cmds, on_line, env=env, deadline_s=150)
    finally:
        if server is not None:
            server.kill()
    print(log)
    return codes, log, out


def at_iteration(n: int, action):
    """An on_line callback that runs `action(agents)` in a thread once iteration `n` is logged."""
    done = []

    def on_line(line, agents):
        m = LINE.search(line)
        if m and int(m.group(1)) >= n and not done:
            done.append(True)
            threading.Thread(target=action, args=(agents,)).start()

    return on_line


@pytest.mark.parametrize("lost_node", [0, 1], ids=["host-of-rank-0", "other-host"])
def test_a_lost_host_leaves_the_other_one_training(tmp_path, reference, lost_node):  # noqa: F811
    lost = {}

    def lose_host(agents):
        agent = next(a for a in agents if group_rank_of(a.pid) == lost_node)
        lost["ranks"] = sorted(int(_env(p)["RANK"]) for p in workers_of(agent.pid))
        await_records(tmp_path / "out", lost["ranks"], 5)  # its last step recorded
        for pid in [agent.pid, *workers_of(agent.pid)]:  # the host's processes, all at once
            os.kill(pid, signal.SIGKILL)

    codes, log, out = two_hosts(tmp_path, [], at_iteration(5, lose_host))
    assert sorted(codes) == [-signal.SIGKILL, 0], (codes, log[-3000:])
    assert lost["ranks"] == [2 * lost_node, 2 * lost_node + 1], lost
    said = f"node rank {lost_node}, ranks {lost['ranks']}) is lost: no keep-alive for "
    assert log.count(said) == 1, log[-3000:]  # one line, by the agent that declared it
    ((it, old, new, left, repeated, source, *_),) = recoveries(log)
    assert (old, left, source) == ("tp2xpp1xdp2", ",".join(map(str, lost["ranks"])), "replicas")
    tp, pp, dp = map(int, re.match(r"tp(\d+)xpp(\d+)xdp(\d+)", new).groups())
    assert tp * pp * dp == 2, new  # the planner's layout for the 2 survivors
    if lost_node == 0:  # rank 0 hosted the control store: a survivor hosts it anew
        assert "now hosts the control store" in log, log[-3000:]
    check_losses(log, reference)
    check_samples(out)
    assert log.count("sendBytes failed") <= 4, log.count("sendBytes failed")


def test_a_hung_worker_on_another_host_is_killed_by_its_own_agent(tmp_path, reference):  # noqa: F811
    def stop_rank_3(agents):
        pid = next(p for a in agents for p in workers_of(a.pid) if _env(p)["RANK"] == "3")
        await_records(tmp_path / "out", [3], 5)  # its last step recorded
        os.kill(pid, signal.SIGSTOP)

    # 10 s: long enough that a loaded machine's slow first steps are not silences
    flags = ["--elastic-heartbeat-timeout", "10"]
    codes, log, out = two_hosts(tmp_path, flags, at_iteration(5, stop_rank_3))
    assert codes == [0, 0], (codes, log[-3000:])
    # its watchers on host a ask host b's agent to kill it, and host b's agent does; rank 2 (on
    # host b) watches it too and may kill it first, the others then no longer wait for it (the
    # agent's side of a request alone: tests/launch/test_hosts.py)
    asked = "asked its host's agent to kill it" in log and "at a watcher's request" in log
    same_host = "watchdog: rank 2: rank 3 (b, pid" in log and "killed it (same host)" in log
    assert "rank 3 (b, pid" in log and (asked or same_host), log[-3000:]
    ((it, old, new, left, *_),) = recoveries(log)
    assert (old, left) == ("tp2xpp1xdp2", "3"), log[-3000:]
    check_losses(log, reference)
    check_samples(out)


def test_a_host_lost_during_a_live_change(tmp_path, reference):  # noqa: F811
    # the operator asks for tp 2 x pp 2 at iteration 4; rank 2 (host b) stops itself as the
    # change builds the new layout's groups; the test then kills host b whole. The survivors
    # recover from what they read from (the old layout's replica on host a) and train on
    port = free_port()
    request = ["layout", "--tp", "2", "--pp", "2", "--at-iteration", "4"]
    tool = subprocess.Popen(
        [sys.executable, "tools/elastic_ctl.py", "--port", str(port), "--timeout", "120", *request],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lost, watching = [], []

    def lose_host_b_once_rank_2_stops(agents):
        deadline = time.monotonic() + 120
        while not lost and time.monotonic() < deadline:
            for agent in agents:
                ranks = {int(_env(p).get("RANK", -1)): p for p in workers_of(agent.pid)}
                if 2 in ranks and _state(ranks[2]) == "T":  # stopped inside the change
                    lost.append(agent.pid)
                    for pid in [agent.pid, *ranks.values()]:
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def on_line(line, agents):
        if not watching and len(agents) == 2:
            watching.append(threading.Thread(target=lose_host_b_once_rank_2_stops, args=(agents,)))
            watching[0].start()

    env = {"RECOVER_TEST_IN_RECONFIGURATION": "2:SIGSTOP", "RECOVER_TEST_AWAIT_REQUEST": "1"}
    try:
        codes, log, out = two_hosts(tmp_path, [], on_line, env, port)
        answer = tool.communicate(timeout=60)[0]
    finally:
        tool.kill()
    assert lost and sorted(codes) == [-signal.SIGKILL, 0], (codes, log[-3000:])
    assert "node rank 1, ranks [2, 3]) is lost" in log, log[-3000:]
    ((it, old, new, left, *_),) = recoveries(log)
    assert left == "2,3", log[-3000:]
    assert "Traceback" not in answer and "frame #" not in answer, answer
    check_losses(log, reference)
    check_samples(out)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _env(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = (kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            return {k.decode(): v.decode() for k, v in pairs}
    except OSError:  # gone meanwhile
        return {}
