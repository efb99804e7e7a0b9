"""Hosts as the unit of failure: each agent's keep-alive in the job's store, the lost host's
failure records, fencing, and kill requests between hosts.

    hosts = HostWatch(store, group_rank=0, host="node-a", ranks={0: 0, 1: 1}, timeout_s=5.0)
    hosts.tick(agents=2)   # the agent, every monitor interval: beat, act on requests, watch peers

Under `python -m megadyn.launch` every agent runs one `HostWatch` over the store its workers
reach at MASTER_ADDR:MASTER_PORT (with a coordinator, `python -m megadyn.launch.coordinator`,
that store outlives every training host). In the attempt's key space:

    hosts/<node rank>          JSON {host, ranks: {global rank: pid}, time}: the agent's
                               keep-alive, written every `interval` seconds
    hosts/<node rank>/lost     set once, by the first agent that found that keep-alive older
                               than `timeout_s`: the host is lost and fenced
    hosts/<node rank>/lost/<k> the same for the k-th replacement of that slot (rejoin.py): a
                               replacement agent beats with `incarnation` k and is fenced by
                               this key only, while the processes before it stay fenced
    kill/<global rank>         a watcher on another host asks that rank's agent to SIGKILL a
                               worker that stopped beating (watchdog.py)

A lost host's workers are recorded as failed (failures.py, one record per rank, `lost_host`
set), exactly as an agent records a worker that died under it, so the survivors on the other
hosts recover in-process. An agent that finds its own host declared lost (it was stopped, or
cut off, for longer than the timeout) is fenced: it kills its workers and ends, so processes of
the old epoch never rejoin the job.

A coordinator that restarts (store_client.py) comes back with an empty store: the agent calls
`resume()`, which sets the lost hosts' keys again and measures every other agent's silence
anew from then, so a keep-alive gap that overlaps the outage does not make a host lost; an
agent that beat before the outage and does not beat again within the timeout after it is.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass

from megadyn.launch import failures

INTERVAL_S = 0.5
"""How often an agent writes its keep-alive and looks at the others'."""


def host_key(group_rank: int) -> str:
    return f"hosts/{group_rank}"


def lost_key(group_rank: int, incarnation: int = 0) -> str:
    """The fence of node rank `group_rank`'s agent; `incarnation` k: its k-th replacement's."""
    return f"hosts/{group_rank}/lost" + (f"/{incarnation}" if incarnation else "")


def kill_key(rank: int) -> str:
    return f"kill/{rank}"


def request_kill(store, rank: int, why: str) -> None:
    """A watcher's side: ask the agent of `rank` (on any host) to SIGKILL it."""
    store.set(kill_key(rank), why)


@dataclass(frozen=True)
class Beat:
    """One agent's last keep-alive, as read from the store."""

    group_rank: int
    host: str
    ranks: dict[int, int]
    """Its workers: global rank -> pid."""
    time: float
    incarnation: int = 0
    """0: the agent of the job's start; k: the agent that replaced that slot's lost host in
    rejoin epoch k (rejoin.py)."""

    @classmethod
    def from_json(cls, group_rank: int, text: bytes | str) -> Beat:
        d = json.loads(text)
        ranks = {int(r): int(p) for r, p in d["ranks"].items()}
        return cls(group_rank, d["host"], ranks, float(d["time"]), int(d.get("incarnation", 0)))


class Fenced(Exception):
    """This agent's own host was declared lost by another agent."""


class HostWatch:
    """One agent's keep-alive and its watch over the other agents (module docstring)."""

    def __init__(
        self,
        store,
        group_rank: int,
        host: str,
        ranks: dict[int, int],
        timeout_s: float,
        *,
        interval: float = INTERVAL_S,
        clock=time.time,
        log=print,
        incarnation: int = 0,
    ):
        """`incarnation`: 0 for an agent of the job's start, k for the agent that replaced
        this slot's lost host in rejoin epoch k (its own fence, Beat.incarnation)."""
        self.store, self.group_rank, self.host = store, group_rank, host
        self.incarnation = incarnation
        self.ranks, self.timeout_s, self.interval = dict(ranks), timeout_s, interval
        self.clock, self.log = clock, log
        self.lost: dict[int, Beat] = {}  # node rank -> its last keep-alive, declared lost here
        self.killed: set[int] = set()  # ranks killed at another host's request
        # a replacement's: requests made for the lost processes of its ranks are not for it
        self._stale = {}
        if incarnation:
            keys = {r: kill_key(r) for r in self.ranks}
            self._stale = {r: store.get(k) for r, k in keys.items() if store.check([k])}
        self._seen: dict[int, tuple[Beat, float]] = {}  # node rank -> (its beat, when it changed)
        self._next = 0.0

    def tick(self, agents: int, alive: set[int] | None = None) -> None:
        """Every monitor interval (acts every `interval` seconds): raise Fenced if this host was
        declared lost; write the keep-alive; kill local workers that a watcher asked to; declare
        the agents among 0..agents-1 whose keep-alive is older than `timeout_s` lost.
        `alive`: the global ranks of this agent's workers that still run."""
        now = self.clock()
        if now < self._next:
            return
        self._next = now + self.interval
        fence = lost_key(self.group_rank, self.incarnation)
        if self.store.check([fence]):
            raise Fenced(self.store.get(fence).decode())
        ranks = {r: p for r, p in self.ranks.items() if alive is None or r in alive}
        self._beat(ranks, now)
        self._serve_kill_requests(ranks)
        for other in range(agents):
            if other != self.group_rank and not self._still_lost(other):
                self._check(other, now)

    def leave(self) -> None:
        """This agent's workers have all ended: a last keep-alive that lists none, so that
        its silence from now on is no lost host."""
        self._beat({}, self.clock())

    def _beat(self, ranks: dict[int, int], now: float) -> None:
        beat = {"host": self.host, "ranks": ranks, "time": now, "incarnation": self.incarnation}
        self.store.set(host_key(self.group_rank), json.dumps(beat))

    def resume(self) -> None:
        """The coordinator came back with an empty store: publish the hosts this agent knows
        are lost again (they stay fenced) and measure the others' silence from now."""
        now = self.clock()
        self._seen = {g: (beat, now) for g, (beat, _) in self._seen.items()}
        self._next = 0.0
        for group_rank, beat in self.lost.items():
            self.store.set(
                lost_key(group_rank, beat.incarnation),
                "declared lost before the coordinator restarted",
            )

    def any_lost(self, agents: int) -> bool:
        """Whether any host of the attempt's `agents` was declared lost (by any agent)."""
        if self.lost:
            return True
        try:
            return any(self.store.check([lost_key(g)]) for g in range(agents))
        except Exception:  # noqa: BLE001 - the store is away: nothing to wait for either
            return True

    def _still_lost(self, other: int) -> bool:
        """Whether node rank `other` is lost and not replaced since (rejoin.py): a replacement's
        keep-alive, of a later incarnation, is watched like any other from then on."""
        lost = self.lost.get(other)
        if lost is None:
            return False
        key = host_key(other)
        if self.store.check([key]):
            beat = Beat.from_json(other, self.store.get(key))
            if beat.incarnation > lost.incarnation:
                del self.lost[other]
                self._seen.pop(other, None)
                return False
        return True

    def _serve_kill_requests(self, ranks: dict[int, int]) -> None:
        for rank, pid in ranks.items():
            key = kill_key(rank)
            if rank in self.killed or not self.store.check([key]):
                continue
            why = self.store.get(key)
            if why == self._stale.get(rank):
                continue
            self.killed.add(rank)
            why = why.decode()
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue  # it ended meanwhile: its exit is recorded like any other
            self.log(
                f"megadyn.launch: killed rank {rank} (pid {pid}) at a watcher's request: {why}"
            )

    def _check(self, other: int, now: float) -> None:
        key = host_key(other)
        if self.store.check([key]):
            beat = Beat.from_json(other, self.store.get(key))
        elif other in self._seen:  # it beat before the coordinator restarted, not since
            beat = self._seen[other][0]
        else:
            return  # not started yet: torchrun's rendezvous waits for it, not this watch
        if not beat.ranks:
            return  # its workers all ended (`leave`): nothing of it to lose
        seen, changed = self._seen.get(other, (None, now))
        if seen is None or seen.time != beat.time:
            self._seen[other] = (beat, now)
            return
        # measured on this agent's clock from the moment it last saw the keep-alive change:
        # hosts' clocks need not agree
        silent = now - changed
        if silent > self.timeout_s:
            self._declare(beat, silent)

    def _declare(self, beat: Beat, silent: float) -> None:
        """Declare `beat`'s host lost (only the first agent to try does) and record its
        workers as failed, so the survivors recover."""
        self.lost[beat.group_rank] = beat
        why = f"no keep-alive for {silent:.1f} s (seen by node rank {self.group_rank})"
        fence = lost_key(beat.group_rank, beat.incarnation)
        if self.store.add(fence + "/claims", 1) != 1:
            return  # another agent declared it
        self.store.set(fence, why)
        for rank, pid in sorted(beat.ranks.items()):
            key = failures.failed_key(rank)
            if (
                self.store.check([key])
                and failures.WorkerFailure.from_json(self.store.get(key)).pid == pid
            ):
                continue  # its own agent recorded it before the host went
            record = failures.WorkerFailure(
                rank=rank,
                local_rank=-1,
                group_rank=beat.group_rank,
                host=beat.host,
                pid=pid,
                exitcode=-int(signal.SIGKILL),
                time=self.clock(),
                lost_host=round(silent, 2),
            )
            failures.record(self.store, record)
        self.log(
            f"megadyn.launch: host {beat.host} (node rank {beat.group_rank}, ranks "
            f"{sorted(beat.ranks)}) is lost: {why}; its workers are recorded as failed and "
            "the survivors recover; it may not rejoin this attempt"
        )
