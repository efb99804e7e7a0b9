"""How the survivors of a failure agree, through a store that outlives every worker.

    feed.dead()                              # {rank: when}: the failures recorded so far
    round = Round(store, dead)               # one key space per set of dead ranks
    round.report(Report(...))                # every survivor, once per round
    reports = round.wait_reports(expected, feed, timeout_s)   # None: more died, start over
    round.decide(decision) / round.wait_decision(feed, timeout_s)
    round.arrive(rank, span, feed, timeout_s)  # False: more died; then connect to each other
    round.serving(rank) / round.wait_serving(rank, feed, timeout_s)  # the control store anew

The control store lives on rank 0, which may be the process that died, so the agreement runs
in the store of torchrun's agent (the runtime hands it over in the `FailureFeed`), in keys of
its own: `recovery/<dead ranks>/report/<rank>` and `recovery/<dead ranks>/decision`. A round
is named by the sorted set of dead ranks: survivors that saw different sets (a second failure
recorded while the first is handled) meet in the round of the larger set, since every wait
also watches the failure records and starts over when they grow. A survivor that never
reports (it died unrecorded, or hangs) ends the wait after `timeout_s` with a RecoveryError.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Protocol


class RecoveryError(RuntimeError):
    """The survivors cannot go on in-process; the message says why (the job then takes the
    restart path)."""


class PeerFailed(Exception):
    """A process of the job died or hung: the survivors recover (raised where this process
    waits on others outside a collective: a step boundary, a standby poll)."""


class FailureFeed(Protocol):
    """The runtime's view of failures (megadyn/launch/failure_watch.py)."""

    store: object
    """A store that outlives every worker (the agent's), for the agreement."""
    timeout_s: float
    """How long a survivor waits for the others to report before giving up."""
    device_done: int | None
    """Where the runtime aborted device communicators (NCCL): the last step whose device work
    had finished before it did (None: nothing was aborted). A collective cut short by an abort
    does not raise, so the steps after it may have gone on with partial results."""

    def dead(self) -> dict[int, float]:
        """Ranks recorded dead so far, with the wall time their failure was seen."""
        ...

    def revive(self, ranks) -> None:
        """`ranks` run again in new processes (a replacement host's): their records so far
        no longer count; a later failure of theirs does."""
        ...


@dataclass(frozen=True)
class Holding:
    """Tensors a survivor kept of one step under a layout that an unfinished recovery left:
    a failure before the first step after a recovery may find them a replica that the
    recovery's own layout lacks (recovery/recovery.py)."""

    iteration: int
    training: dict
    layout: dict
    members: list[int]


@dataclass(frozen=True)
class Report:
    """What one survivor says about itself."""

    rank: int
    member: bool
    """It trained under the old layout (else it waited as standby)."""
    iteration: int | None = None
    """The step its tensors are at (None: standby, or stopped inside an update)."""
    training: dict | None = None
    """Its TrainingState JSON at `iteration`."""
    layout: dict | None = None
    members: list[int] = field(default_factory=list)
    group_count: int = 0
    """How many process groups it has drawn names for (sequential names must agree)."""
    host: str = ""
    """Its host name (where the control store goes when its host died)."""
    earlier: list[Holding] = field(default_factory=list)
    """Older holdings, newest first (its RNG streams: `rng/<rank>/<1 + index>`)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text) -> Report:
        fields = json.loads(text)
        earlier = [Holding(**h) for h in fields.pop("earlier", [])]
        return cls(**fields, earlier=earlier)


def poll(ready, timeout_s: float, interval: float = 0.02, first: float | None = None):
    """Call `ready()` until it returns something other than None and return that; None once
    `timeout_s` passed. The pause between calls starts at `first` (default `interval`) and
    doubles up to `interval`. Every wait of the recovery and of the failure records is one."""
    deadline = time.monotonic() + timeout_s
    delay = interval if first is None else first
    while True:
        value = ready()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(delay)
        delay = min(interval, delay * 2)


_MORE_DIED = object()


def _poll(ready, feed: FailureFeed, seen: set[int], timeout_s: float, what: str):
    """Poll `ready()` until it returns a value; None when more failures were recorded than
    `seen`; RecoveryError after `timeout_s`."""

    def ready_or_more_died():
        value = ready()
        if value is None and set(feed.dead()) - seen:
            return _MORE_DIED
        return value

    value = poll(ready_or_more_died, timeout_s, interval=0.05, first=0.002)
    if value is None:
        raise RecoveryError(f"{what} did not come within {timeout_s:.0f} s")
    return None if value is _MORE_DIED else value


def more_failures(feed: FailureFeed, seen: set[int], timeout_s: float) -> bool:
    """Whether a failure beyond `seen` gets recorded within `timeout_s`."""
    return poll(lambda: bool(set(feed.dead()) - seen) or None, timeout_s) is not None


class Round:
    """The keys of one round of agreement: the failure of the ranks in `dead`."""

    def __init__(self, store, dead: set[int]):
        self.dead = set(dead)
        name = "-".join(map(str, sorted(dead)))
        self.store, self.prefix = store, f"recovery/{name}/"

    def report(self, report: Report) -> None:
        self.store.set(f"{self.prefix}report/{report.rank}", report.to_json())

    def wait_reports(
        self, expected: list[int], feed: FailureFeed, timeout_s: float
    ) -> dict[int, Report] | None:
        """Every expected survivor's report; None when another failure was recorded."""
        keys = [f"{self.prefix}report/{r}" for r in expected]

        def ready():
            if not self.store.check(keys):
                return None
            return {r: Report.from_json(v) for r, v in zip(expected, self.store.multi_get(keys))}

        missing = lambda: [r for r, k in zip(expected, keys) if not self.store.check([k])]  # noqa: E731
        try:
            return _poll(ready, feed, self.dead, timeout_s, "the survivors' reports")
        except RecoveryError as e:
            raise RecoveryError(f"{e} (no report from rank(s) {missing()})") from None

    def decide(self, decision: dict) -> None:
        self.store.set(f"{self.prefix}decision", json.dumps(decision))

    def wait_decision(self, feed: FailureFeed, timeout_s: float) -> dict | None:
        key = f"{self.prefix}decision"

        def ready():
            return json.loads(self.store.get(key)) if self.store.check([key]) else None

        return _poll(ready, feed, self.dead, timeout_s, "the recovery decision")

    def arrive(self, rank: int, expected: list[int], feed: FailureFeed, timeout_s: float) -> bool:
        """Wait until every process of `expected` arrived here too (before processes connect
        to each other: a process group's creation waits on a dead peer for the group's whole
        timeout); False when another failure was recorded meanwhile."""
        self.store.set(f"{self.prefix}arrived/{rank}", b"1")
        keys = [f"{self.prefix}arrived/{r}" for r in expected]
        return self._keys_set(keys, feed, timeout_s, "every survivor's arrival")

    def serving(self, rank: int) -> None:
        """Process `rank` serves the control store anew (its host died); a key of no round:
        a later round with the same host finds it."""
        self.store.set(f"recovery/control/{rank}", b"1")

    def wait_serving(self, rank: int, feed: FailureFeed, timeout_s: float) -> bool:
        """Wait until process `rank` serves the control store (a client's connection would
        wait for the server without watching the failure records); False when another
        failure was recorded meanwhile."""
        return self._keys_set(
            [f"recovery/control/{rank}"], feed, timeout_s, "the new control store"
        )

    def _keys_set(self, keys: list[str], feed: FailureFeed, timeout_s: float, what: str) -> bool:
        """Wait until every key of `keys` is set; False when another failure was recorded."""
        ready = lambda: True if self.store.check(keys) else None  # noqa: E731
        return _poll(ready, feed, self.dead, timeout_s, what) is not None

    def publish(self, name: str, value: bytes) -> None:
        self.store.set(f"{self.prefix}{name}", value)

    def read(self, name: str) -> bytes | None:
        key = f"{self.prefix}{name}"
        return self.store.get(key) if self.store.check([key]) else None
