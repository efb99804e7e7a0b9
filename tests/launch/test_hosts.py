"""Host keep-alives (megadyn/launch/hosts.py) on one store, with a clock the test moves: a
silent host is declared lost once, by one agent, its workers recorded as failed; the lost
host's agent is fenced; a kill request reaches the worker's own agent; a coordinator's restart
makes no host lost, and a host that does not beat again after it is; a lost host's slot is
claimed by one replacement only, which has a fence of its own and is watched (and declared lost)
like any other host; and the launcher's --coordinator flag becomes torchrun's rendezvous flags
(megadyn's backend: rendezvous.py)."""

import signal
import subprocess
import sys

import pytest
import torch.distributed as dist

from megadyn.launch import failures, hosts, rejoin
from megadyn.launch.__main__ import parse_args


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def agents(store, clock, timeout_s=2.0):
    """Three agents of 2 workers each (global ranks 2g, 2g+1), every one with its own log."""
    logs = {g: [] for g in range(3)}
    watches = [
        hosts.HostWatch(store, g, f"host{g}", {2 * g: 100 + 2 * g, 2 * g + 1: 101 + 2 * g},
                        timeout_s, interval=0.5, clock=clock, log=logs[g].append)
        for g in range(3)
    ]  # fmt: skip
    return watches, logs


def tick(watches, clock, seconds, skip=()):
    """Move the clock in half-second ticks; the agents in `skip` stay silent."""
    for _ in range(int(seconds / 0.5)):
        clock.now += 0.5
        for w in watches:
            if w.group_rank not in skip:
                w.tick(agents=len(watches))


def test_a_replacement_takes_a_lost_slot_once_and_is_watched_like_any_host():
    store, clock = dist.HashStore(), Clock()
    watches, logs = agents(store, clock)
    assert rejoin.claim(store, 3, 2, "spare") is None  # nothing is lost yet
    tick(watches, clock, 3)
    tick(watches, clock, 3, skip={1})  # host1 is lost
    slot = rejoin.claim(store, 3, 2, "spare")
    assert (slot.epoch, slot.group_rank, slot.ranks, slot.nnodes) == (1, 1, (2, 3), 3)
    assert rejoin.claim(store, 3, 2, "other") is None  # one replacement a slot
    hosts.request_kill(store, 2, "the lost rank 2 was silent")  # meant for the lost process
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        spare = hosts.HostWatch(store, 1, "spare", {2: worker.pid, 3: 203}, 2.0, interval=0.5,
                                clock=clock, log=logs[1].append, incarnation=slot.epoch)  # fmt: skip
        watches[1] = spare
        tick(watches, clock, 3)  # the spare beats: not fenced, not killed, not declared lost
        assert worker.poll() is None and spare.killed == set()
    finally:
        worker.kill()
    assert store.add(failures.COUNT_KEY, 0) == 2
    tick(watches, clock, 3, skip={1})  # the spare is lost in turn: its own fence, new records
    records = failures.read(store, 6)
    assert records[2].pid == worker.pid and records[3].pid == 203
    with pytest.raises(hosts.Fenced):
        tick(watches, clock, 0.5)
    assert rejoin.claim(store, 3, 2, "third").epoch == 2  # that slot can be replaced again


def test_a_silent_host_is_declared_lost_once_and_fenced():
    store, clock = dist.HashStore(), Clock()
    watches, logs = agents(store, clock)
    tick(watches, clock, 3)
    assert failures.read(store, 6) == {}  # every agent beats: nothing is lost
    tick(watches, clock, 3, skip={1})  # host1 stops (its agent and workers are gone)
    records = failures.read(store, 6)
    assert sorted(records) == [2, 3] and all(r.lost_host >= 2.0 for r in records.values())
    assert records[2].describe().startswith("rank 2 (on host1, pid 102) lost with its host")
    assert store.add(failures.COUNT_KEY, 0) == 2
    declared = [line for g in (0, 2) for line in logs[g] if "is lost" in line]
    assert len(declared) == 1 and "host host1 (node rank 1, ranks [2, 3])" in declared[0]
    assert all(w.any_lost(3) for w in watches)
    with pytest.raises(hosts.Fenced, match="no keep-alive"):  # it comes back: fenced
        tick(watches, clock, 0.5)


def test_a_host_whose_worker_was_recorded_keeps_that_record():
    store, clock = dist.HashStore(), Clock()
    watches, _ = agents(store, clock)
    tick(watches, clock, 1)
    dead = failures.WorkerFailure(4, 0, 2, "host2", 104, -9, clock.now)
    failures.record(store, dead)  # its agent saw rank 4 die just before the host went
    tick(watches, clock, 3, skip={2})
    records = failures.read(store, 6)
    assert records[4] == dead and records[5].lost_host is not None
    assert store.add(failures.COUNT_KEY, 0) == 2


def test_a_coordinator_restart_is_not_a_lost_host():
    store, clock = dist.HashStore(), Clock()
    watches, logs = agents(store, clock)
    tick(watches, clock, 2)
    watches[0].lost[7] = hosts.Beat(7, "host7", {14: 1}, 0.0)  # declared lost before
    clock.now += 10  # the coordinator is down for 10 s (> the 2 s timeout): nobody can beat
    store = dist.HashStore()  # ... and comes back empty
    for w in watches:
        w.store = store
        w.resume()
    assert store.check([hosts.lost_key(7)])  # still fenced
    tick(watches, clock, 1.5, skip={2})  # host2's agent has not beaten again: 1.5 s < 2 s
    assert failures.read(store, 6) == {}
    tick(watches, clock, 1.5, skip={2})  # ... and does not: lost, silent since the restart
    assert sorted(failures.read(store, 6)) == [4, 5]
    assert [line for g in (0, 1) for line in logs[g] if "is lost" in line][0].startswith(
        "megadyn.launch: host host2 (node rank 2, ranks [4, 5]) is lost"
    )


def test_a_kill_request_reaches_the_workers_own_agent():
    store, clock = dist.HashStore(), Clock()
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        logs = []
        watch = hosts.HostWatch(store, 0, "a", {7: victim.pid}, 5.0, clock=clock, log=logs.append)
        hosts.request_kill(store, 7, "rank 7 sent no heartbeat for 3.2 s")
        watch.tick(agents=1)
        assert victim.wait(timeout=10) == -signal.SIGKILL
        assert logs == [
            f"megadyn.launch: killed rank 7 (pid {victim.pid}) at a watcher's request: "
            "rank 7 sent no heartbeat for 3.2 s"
        ]
        clock.now += 1
        watch.tick(agents=1)  # once
        assert len(logs) == 1
    finally:
        victim.kill()


def test_the_coordinator_flag_is_torchruns_rendezvous():
    args, _ = parse_args(["--nnodes", "2", "--coordinator", "10.0.0.5:29400", "train.py"])
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_conf) == (
        "megadyn", "10.0.0.5:29400", "",
    )  # fmt: skip
    assert args.coordinator == ("10.0.0.5", 29400) and args.host_timeout == 5.0
    for bad, said in [
        (["--coordinator", "nohostport"], "--coordinator must be HOST:PORT"),
        (["--coordinator", "h:1", "--rdzv-endpoint", "g:2"], "contradicts it"),
        (["--host-timeout", "-1"], "--host-timeout must be >= 0"),
    ]:
        run = subprocess.run([sys.executable, "-m", "megadyn.launch", *bad, "train.py"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert run.returncode == 2 and said in run.stderr, run.stderr


def test_the_coordinator_serves_until_told_to_stop():
    from megadyn.testing import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "megadyn.launch.coordinator", "--host", "127.0.0.1"]
    proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith(
            f"megadyn coordinator: serving on 127.0.0.1:{port}"
        )
        client = dist.TCPStore("127.0.0.1", port, is_master=False)
        client.set("k", "v")
        assert dist.TCPStore("127.0.0.1", port, is_master=False).get("k") == b"v"
        busy = subprocess.run(
            [*cmd, "--port", str(port)], capture_output=True, text=True, timeout=120
        )
        assert busy.returncode == 2 and f"cannot serve on 127.0.0.1:{port}" in busy.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "megadyn coordinator: stopped" in proc.stdout.read()
    finally:
        proc.kill()


def test_a_replacement_without_its_coordinator_says_so_in_one_line(tmp_path):
    """A mistyped or dead --coordinator: one line naming the flag and the address, exit 2, no
    traceback and no worker started."""
    from megadyn.testing import free_port

    script = tmp_path / "train.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    port = free_port()  # nothing serves there
    cmd = [sys.executable, "-m", "megadyn.launch", "--coordinator", f"127.0.0.1:{port}",
           "--nnodes", "2", "--nproc-per-node", "1", "--replace-lost-host",
           "--replace-wait", "1", str(script)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    out = run.stdout + run.stderr
    assert run.returncode == 2, out
    assert f"no coordinator answered at 127.0.0.1:{port} (--coordinator)" in out
    assert "Traceback" not in out and not (tmp_path / "train.py.ran").exists()
