"""Who died: the failure records `python -m megadyn.launch` keeps in the agent's store, read by
the workers that survive it.

    store = dist.PrefixStore(attempt_prefix(restart), agent_store(timeout))   # a worker
    failures.declare_recovering(store)      # this attempt's workers recover in-process
    ...                                     # a collective raised: a peer is gone
    dead = failures.wait_for(store, world, timeout=5.0)      # {global rank: WorkerFailure}

Under the launcher with survivors kept (agent.py), an agent whose worker exits non-zero or is
killed by a signal while other workers of its group still run leaves those running and writes,
in the attempt's key space of the store the workers reach at MASTER_ADDR:MASTER_PORT
(`attempt_prefix`, megadyn/launch/distributed_init.py; every host's agent writes to the same
store),

    failed/<global rank>   JSON of a WorkerFailure: rank, local rank, node rank, host, pid,
                           exit code (negative: killed by that signal), signal name, wall time
    failed/count           how many failures were recorded (a counter: `store.add`)

The agent keeps survivors only once the attempt's workers said they can carry on without a
peer (`declare_recovering`: the key `survivors_recover`); until then a failure takes
torchrun's path (every local worker stopped, the group restarted or the job failed), so a job
whose workers do not recover in-process loses no time waiting for them to notice.
"""

from __future__ import annotations

import json
import signal
from dataclasses import asdict, dataclass

from megadyn.elastic.recovery.agreement import poll

RECOVERING_KEY = "survivors_recover"
"""Set by the workers of an attempt (any one of them) once they recover from a peer's death."""
COUNT_KEY = "failed/count"
"""How many failures the agents recorded in the attempt."""


def failed_key(rank: int) -> str:
    """The key of global rank `rank`'s failure record (in the attempt's key space)."""
    return f"failed/{rank}"


@dataclass(frozen=True)
class WorkerFailure:
    """One worker that ended with a non-zero exit code or a signal, as its agent saw it."""

    rank: int
    """Its global rank in the attempt."""
    local_rank: int
    group_rank: int
    """The agent (node rank) that ran it."""
    host: str
    """The agent's host name."""
    pid: int
    exitcode: int
    """Its exit status; negative: killed by signal -exitcode."""
    time: float
    """Wall-clock time at which the agent saw it gone (at most one monitor interval late)."""
    lost_host: float | None = None
    """Set when its whole host was lost (hosts.py): how long its agent had been silent, in
    seconds; `local_rank` is then -1 and `exitcode` SIGKILL's (its fate is unknown)."""

    @property
    def signal(self) -> str | None:
        """The signal's name (SIGKILL) when a signal ended it."""
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def describe(self) -> str:
        if self.lost_host is not None:
            return (
                f"rank {self.rank} (on {self.host}, pid {self.pid}) lost with its host (its "
                f"agent silent for {self.lost_host:.1f} s)"
            )
        how = f"killed by {self.signal}" if self.signal else f"exited with {self.exitcode}"
        return (
            f"rank {self.rank} (local rank {self.local_rank} on {self.host}, pid {self.pid}) {how}"
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerFailure:
        return cls(**json.loads(text))


def record(store, failure: WorkerFailure) -> None:
    """The agent's side: publish `failure` (its key first, then the counter)."""
    store.set(failed_key(failure.rank), failure.to_json())
    store.add(COUNT_KEY, 1)


def declare_recovering(store) -> None:
    """The workers' side: from now on the agents keep survivors when a worker of this attempt
    fails (each agent reads the key at the failure)."""
    store.set(RECOVERING_KEY, "1")


def recovering(store) -> bool:
    """Whether the attempt's workers declared that they recover in-process."""
    return store.check([RECOVERING_KEY])


def read(store, world_size: int) -> dict[int, WorkerFailure]:
    """The failures recorded so far among ranks 0..world_size-1, by rank."""
    keys = [failed_key(r) for r in range(world_size)]
    present = [k for k in keys if store.check([k])]
    values = store.multi_get(present) if present else []
    return {int(k.split("/")[-1]): WorkerFailure.from_json(v) for k, v in zip(present, values)}


def wait_for(store, world_size: int, timeout: float, seen: int = 0) -> dict[int, WorkerFailure]:
    """The workers' side, after a collective found a peer gone: wait up to `timeout` seconds for
    more than `seen` failures to be recorded (the agent polls its workers every monitor
    interval), then read them all. Empty when none came: the peer may be hung, not dead."""
    if poll(lambda: store.add(COUNT_KEY, 0) > seen or None, timeout) is None:
        return {}
    return read(store, world_size)
