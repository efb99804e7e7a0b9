"""A replacement host joins a running job after a lost host: the survivors keep their processes,
and the job grows back to its first layout (megadyn/launch/rejoin.py, replacement.py).

Two simulated hosts (a and b) of 2 gloo workers each, tp 2 x dp 2, through a coordinator of
their own (test_lost_host.py's helpers). A whole host is SIGKILLed at iteration 5 (the host of
rank 0 or the other one); the survivors recover in-process on the planner's layout for 2. A third agent,
`python -m megadyn.launch --replace-lost-host` as host c, is started right after the kill: it
waits for the slot to be declared lost, claims it, and its workers join at a step boundary (the
leader's first one after the recovery waits for them: RECOVER_TEST_AWAIT_REJOIN).
With --max-restarts 0:
- both remaining agents exit 0;
- one reconfiguration, event "rejoin", from the survivors' layout back to tp2xpp1xdp2;
- every loss equals an uninterrupted run's within 1e-5 (at most the interrupted step twice)
  and every sample was drawn once;
- the survivors' worker processes are the same before the kill and after the rejoin.
"""

import os
import re
import signal
import subprocess
import threading
import time

import pytest
from recovery_helpers import LINE, REPO, workers_of
from test_in_process_recovery import (
    check_losses,
    check_samples,
    recoveries,
    reference,  # noqa: F401 - the module's fixture
)
from test_lost_host import coordinator, two_hosts
from test_restarts import group_rank_of

from megadyn.testing import free_port

REJOINED = re.compile(r"elastic: event: rejoin \| .*?old: (\S+) \| new: (\S+) \|")
STEP_S = "0.2"
"""Seconds each step sleeps: the host is lost before the job's end."""
ENV = {"RECOVER_TEST_STEP_S": STEP_S, "RECOVER_TEST_AWAIT_REJOIN": "1"}
"""The leader's first step boundary after the recovery waits for the replacement's workers."""


@pytest.mark.parametrize("lost_node", [1, 0], ids=["other-host", "host-of-rank-0"])
def test_a_replacement_host_rejoins_the_job(tmp_path, reference, lost_node):  # noqa: F811
    state = {"lines": []}
    replacement_log = tmp_path / "replacement.log"

    def lose_host_and_replace_it(agents):
        lost = next(a for a in agents if group_rank_of(a.pid) == lost_node)
        kept = next(a for a in agents if a is not lost)
        state["survivors"] = sorted(workers_of(kept.pid))
        for pid in [lost.pid, *workers_of(lost.pid)]:  # the host's processes, all at once
            os.kill(pid, signal.SIGKILL)
        launch = lost.args[2:]  # after "env MEGADYN_HOST=..."
        at = launch.index("tests/elastic/recover_worker.py")
        cmd = ["env", "MEGADYN_HOST=c", *launch[:at], "--replace-lost-host", *launch[at:]]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
                   RECOVER_TEST_OUT=str(tmp_path / "out"), **ENV)  # fmt: skip
        with open(replacement_log, "w") as log:
            state["replacement"] = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "after" not in state:  # the survivors, rejoined
            if REJOINED.search(replacement_log.read_text() + "".join(state["lines"])):
                state["after"] = sorted(workers_of(kept.pid))
            time.sleep(0.05)

    def on_line(line, agents):
        state["lines"].append(line)
        m = LINE.search(line)
        if m and int(m.group(1)) >= 5 and "replacement" not in state and "lost" not in state:
            state["lost"] = True
            threading.Thread(target=lose_host_and_replace_it, args=(agents,)).start()

    server = coordinator(port := free_port())  # it outlives the hosts: the replacement's too
    try:
        codes, log, out = two_hosts(tmp_path, [], on_line, ENV, port=port)
        code = state["replacement"].wait(timeout=60)
    finally:
        server.kill()
        if "replacement" in state:
            for pid in workers_of(state["replacement"].pid):
                os.kill(pid, signal.SIGKILL)
            state["replacement"].kill()
        print(replacement_log.read_text() if replacement_log.exists() else "")
    log += replacement_log.read_text()
    assert sorted(codes) == [-signal.SIGKILL, 0] and code == 0, (codes, code, log[-3000:])
    ((it, old, shrunk, left, *_),) = recoveries(log)
    assert old == "tp2xpp1xdp2" and left == f"{2 * lost_node},{2 * lost_node + 1}", log[-3000:]
    assert REJOINED.findall(log) == [(shrunk, "tp2xpp1xdp2")], log[-3000:]  # grown back
    assert f"replaces lost node rank {lost_node}: ranks" in log, log[-3000:]
    assert state["after"] == state["survivors"], state  # no survivor was restarted
    check_losses(log, reference)
    check_samples(out)
