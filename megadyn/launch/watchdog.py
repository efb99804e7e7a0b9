"""Heartbeats through torchrun's agent store: a hung rank is named, and the job restarts instead
of waiting in a collective; a restarted job logs how long its recovery took.

    watchdog = Watchdog.start(cfg.elastic.heartbeat_timeout)  # None unless under torchrun
    trainer = Trainer(cfg, groups, device, hooks=[watchdog.step_hook])
    trainer.train()
    watchdog.stop()                     # this rank is done: the others stop watching it

Each rank runs one daemon thread. Every `interval` seconds it writes, in the attempt's key space
of the agent's store (`attempt_prefix`, megadyn/launch/distributed_init.py),

    heartbeat/world     the attempt's world size
    heartbeat/progress  the last completed step, as the logging rank's thread last saw it
    heartbeat/<rank>    JSON {"time": wall clock, "iteration": last completed step, "host", "pid",
                        "done": true once the rank finished}

and reads the keys of the `WATCHED` ranks after it (every other rank in jobs of up to 17) in one
`multi_get`. A rank whose key has not changed for `timeout` seconds (as this rank's monotonic
clock sees it, so host clocks need not agree) and is not done makes each rank watching it print
one line naming it and exit with `HUNG_PEER_EXIT`; the agent then restarts the worker group. A
silent rank on the same host is SIGKILLed first: the agent would wait 30 s for a hung process
that ignores its SIGTERM. A rank that dies is the agent's to notice. When the survivors recover
in-process (`keep_going`, under megadyn.launch), the watchers SIGKILL a silent rank on their
host, or ask the agent of its host to (hosts.py: `kill/<rank>` in the store), which then
records it as any dead worker, and go on; ranks recorded dead are no longer watched (`forget`).

Under `python -m megadyn.launch --coordinator` the store may restart (coordinator.py). While
it does not answer, the thread prints one line and neither beats nor watches: the ranks train
on, nobody is killed for the outage. When a coordinator comes back at the same address, its
client reconnects (store_client.py), the thread publishes its keys again, prints one line, and
the silence of every watched rank is measured anew from then.

The keys outlive the attempt, so a restarted job reads the previous attempt's: the failure is
dated by the last heartbeat of the rank that went silent first (at most one interval before the
failure: the number errs long), and the first completed step after the restart logs the seconds
since then (clocks of different hosts must agree for that). When torchrun stops the other
workers within one interval of a kill, the first rank to go silent need not be the one killed.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from megadyn.launch import hosts, startup, torchrun_env
from megadyn.launch.console import print_line
from megadyn.launch.distributed_init import agent_store, attempt_prefix
from megadyn.launch.store_client import CoordinatorDown, ReconnectingStore

WATCHED = 16
"""Ranks each rank watches (the next ones around the ring), so the store's load grows with the
world size, not with its square."""
HUNG_PEER_EXIT = 75
"""Exit status of a rank that found a silent peer (EX_TEMPFAIL: try again, torchrun)."""


@dataclass(frozen=True)
class PreviousAttempt:
    """What the heartbeats of the attempt before this one say about its end."""

    attempt: int
    silent_rank: int
    """The rank whose heartbeats stopped first: the failed one."""
    last_heartbeat: float
    """Wall-clock time of its last heartbeat (the failure happened at most one interval later)."""
    iteration: int
    """The furthest step any rank of the attempt completed."""
    host: str


def attempt_world(store, attempt: int) -> int | None:
    """The world size attempt `attempt` published in the agent's `store`; None before its
    workers started (a replacement host reads it: replacement.py)."""
    beats = dist.PrefixStore(attempt_prefix(attempt) + "heartbeat/", store)
    return int(beats.get("world")) if beats.check(["world"]) else None


def read_previous_attempt(store, attempt: int) -> PreviousAttempt | None:
    """The heartbeats attempt `attempt` left in the agent's `store`; None when it left none."""
    beats = dist.PrefixStore(attempt_prefix(attempt) + "heartbeat/", store)
    if not beats.check(["world"]):
        return None
    keys = [str(r) for r in range(int(beats.get("world")))]
    ranks = [int(k) for k in keys if beats.check([k])]  # a rank may have died before its first
    if not ranks:
        return None
    values = dict(zip(ranks, (json.loads(v) for v in beats.multi_get([str(r) for r in ranks]))))
    live = {r: v for r, v in values.items() if not v["done"]} or values
    silent = min(live, key=lambda r: live[r]["time"])
    iteration = max(v["iteration"] for v in values.values())
    if beats.check(["progress"]):
        iteration = max(iteration, int(beats.get("progress")))
    return PreviousAttempt(
        attempt=attempt,
        silent_rank=silent,
        last_heartbeat=live[silent]["time"],
        iteration=iteration,
        host=live[silent]["host"],
    )


class Watchdog:
    def __init__(
        self, store, rank: int, world: int, timeout: float, restart: int, print_fn=print_line
    ):
        """Use `Watchdog.start`; `store` is a client of the agent's store (not shared with the
        process group: this rank's thread uses it alone)."""
        self.rank, self.world, self.timeout, self.restart = rank, world, timeout, restart
        self.interval = min(1.0, timeout / 10) if timeout else 1.0
        self.print = print_fn
        self.iteration = 0  # written by the training loop, read by the thread
        self.progress: int | None = None  # the same, on the trainer's logging rank
        self.store = store
        self.attempt_store = dist.PrefixStore(attempt_prefix(restart), store)
        self.beats = dist.PrefixStore(attempt_prefix(restart) + "heartbeat/", store)
        # the ranks this one watches: the next WATCHED ones around the ring (all, in small jobs)
        self.watched = [str((rank + i) % world) for i in range(1, min(world, WATCHED + 1))]
        self._reported = False
        self.keep_going = False  # survivors recover in-process: kill a hung rank, stay up
        self._forgotten: set[str] = set()
        self._seen: dict[str, tuple[bytes, float]] = {}  # key -> (value, when it last changed)
        self._since = time.monotonic()  # silences are measured from here at the latest
        self._coordinator_down = False
        if isinstance(store, ReconnectingStore):
            store.on_reconnect.append(self._coordinator_back)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megadyn-heartbeat", daemon=True)

    @classmethod
    def start(cls, timeout: float, print_fn=print_line) -> Watchdog | None:
        """Start this rank's heartbeats (and, with `timeout` > 0, the silence check); None when
        the job does not run under torchrun's elastic agent (nothing would restart it)."""
        restart = torchrun_env.current().restart_count
        if restart is None:
            return None
        store = agent_store(timedelta(seconds=max(30.0, timeout)), wait_s=0)
        watchdog = cls(store, dist.get_rank(), dist.get_world_size(), timeout, restart, print_fn)
        watchdog.beats.set("world", str(watchdog.world))
        watchdog._beat(done=False)
        watchdog._thread.start()
        return watchdog

    # --- the training loop's side ------------------------------------------------------------
    def step_hook(self, trainer) -> None:
        """After every step: the iteration goes into the heartbeats; the first step completed
        after a restart logs the recovery time (on the trainer's logging rank)."""
        self.iteration = trainer.state.iteration
        if trainer.logs:
            self.progress = self.iteration
        if self._reported or not self.restart:
            return
        self._reported = True
        startup.mark("first step")
        if trainer.logs:
            previous = read_previous_attempt(self.store, self.restart - 1)
            self.print(self.recovery_line(self.iteration, previous), flush=True)

    def recovery_line(self, iteration: int, prev: PreviousAttempt | None) -> str:
        """The log line of the first step completed (`iteration`) after a restart."""
        resumed = iteration - 1
        head = f" recovery: restart {self.restart} | resumed from iteration {resumed} | "
        if prev is None:
            return head + f"attempt {self.restart - 1} left no heartbeats: recovery time unknown"
        repeated = max(0, prev.iteration - resumed)
        span = f" ({resumed + 1}-{prev.iteration})" if repeated else ""
        return head + (
            f"iterations repeated: {repeated}{span} | failure to completed step {iteration}: "
            f"{time.time() - prev.last_heartbeat:.1f} s, measured from the last heartbeat of "
            f"rank {prev.silent_rank} ({prev.host}), the first to go silent in attempt "
            f"{prev.attempt} | {startup.timeline(since=prev.last_heartbeat)}"
        )

    def forget(self, ranks) -> None:
        """Stop watching `ranks` (they were recorded dead)."""
        self._forgotten |= {str(r) for r in ranks}

    def remember(self, ranks) -> None:
        """Watch `ranks` again (a replacement host's processes took them: rejoin.py), their
        silence measured from now."""
        for rank in ranks:
            self._forgotten.discard(str(rank))
            self._seen.pop(str(rank), None)

    def stop(self) -> None:
        """This rank is done: mark it so, and end the thread."""
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self._beat(done=True)
        except Exception:  # noqa: BLE001 - the agent's store is gone: nobody is watching
            pass

    # --- the thread ---------------------------------------------------------------------------
    def _beat(self, done: bool) -> None:
        value = {
            "time": time.time(),
            "iteration": self.iteration,
            "host": torchrun_env.host_identity(),
            "pid": os.getpid(),
            "done": done,
        }
        self.beats.set(str(self.rank), json.dumps(value))
        if self.progress is not None:
            self.beats.set("progress", str(self.progress))

    def _coordinator_back(self) -> None:
        """A coordinator came back with an empty store (the thread's own call reconnected):
        publish this rank's keys again and measure every silence from now."""
        self.beats.set("world", str(self.world))
        self._beat(done=False)
        self._seen.clear()
        self._since = time.monotonic()
        self._coordinator_down = False
        self.print(
            f" watchdog: rank {self.rank}: the coordinator is back: heartbeats published again",
            flush=True,
        )

    def _run(self) -> None:
        others, seen = self.watched, self._seen
        last_ok = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                self._beat(done=False)
                present = [k for k in others if k in seen or self.beats.check([k])]
                values = self.beats.multi_get(present) if present else []
                last_ok = now
            except CoordinatorDown as e:  # never a reason to end a worker
                last_ok = now
                if not self._coordinator_down:
                    self._coordinator_down = True
                    self.print(
                        f" watchdog: rank {self.rank}: {e}: training goes on; heartbeats and "
                        "failure handling wait for it to come back",
                        flush=True,
                    )
                continue
            except Exception as e:  # noqa: BLE001 - the store did not answer this time
                if self.timeout and now - last_ok > self.timeout:
                    self._exit(
                        f"the agent's store has not answered for {now - last_ok:.0f} s ({e})"
                    )
                continue
            if not self.timeout:
                continue
            for key, value in zip(present, values):
                if key not in seen or seen[key][0] != value:
                    seen[key] = (value, now)
            for key in others:
                if key in self._forgotten:
                    continue
                value, changed = seen.get(key, (None, self._since))
                if value is not None and json.loads(value)["done"]:
                    continue
                # a rank not heard from yet gets twice the timeout to start
                limit = self.timeout * (2 if value is None else 1)
                if now - changed > limit:
                    beat = json.loads(value) if value is not None else {}
                    where = " ({host}, pid {pid})".format(**beat) if beat else ""
                    killed = _kill_if_here(int(key), beat)
                    silent = (
                        f"rank {key}{where} sent no heartbeat for {now - changed:.1f} s "
                        f"(--elastic-heartbeat-timeout {self.timeout:g})"
                    )
                    if self.keep_going and beat:  # the agent records it; survivors recover
                        self._forgotten.add(key)
                        if not killed:  # on another host: its agent kills it (hosts.py)
                            hosts.request_kill(self.attempt_store, int(key), silent)
                        how = (
                            "killed it (same host)"
                            if killed
                            else "asked its host's agent to kill it"
                        )
                        self.print(
                            f" watchdog: rank {self.rank}: {silent}; {how}, the survivors recover",
                            flush=True,
                        )
                        continue
                    self._exit(silent + ("; killed it (same host)" if killed else ""))

    def _exit(self, why: str) -> None:
        self.print(
            f" watchdog: rank {self.rank}: {why}; exiting so that torchrun restarts the job",
            flush=True,
        )
        os._exit(HUNG_PEER_EXIT)


def _kill_if_here(rank: int, beat: dict) -> bool:
    """SIGKILL a silent rank that runs on this host, after checking that the pid is still that
    worker of this job. A hung process may ignore SIGTERM (a stopped one does), and torchrun's
    agent waits 30 s before its SIGKILL when it stops the worker group for the restart."""
    if beat.get("host") != torchrun_env.host_identity():
        return False
    try:
        with open(f"/proc/{beat['pid']}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        run_id = (torchrun_env.current().run_id or "").encode()
        if env.get(b"RANK") != str(rank).encode() or env.get(b"TORCHELASTIC_RUN_ID") != run_id:
            return False
        os.kill(beat["pid"], signal.SIGKILL)
        return True
    except OSError:  # gone already, or not ours to read
        return False
