"""Watch the agent's failure records from a thread: the survivors' first sign of a dead peer.

    watch = FailureWatch.start(timeout_s=60, abort_nccl=True)   # under megadyn.launch
    watch.trainer = trainer                   # the runtime, whenever its trainer changes
    watch.dead()            # {rank: time the agent saw it gone}, as the thread last read it
    watch.stop()

Under `python -m megadyn.launch` (survivors kept, MEGADYN_KEEP_SURVIVORS=1), the agent records
a worker that died in the attempt's key space of its store (failures.py: `failed/<rank>` and
the counter `failed/count`). A collective with a dead peer raises on gloo only in that peer's
direct neighbours, and on NCCL not at all until a timeout, so every process watches the
counter, with its own client of the store, every `interval` seconds. When the set grows, on
NCCL (`abort_nccl`) the thread notes the last step whose device work had finished
(`device_done`: the steps after it may have used a collective cut short, which does not raise)
and aborts the communicators, which ends the collectives waiting on the dead rank; then it
runs `on_failure(dead)`. The elastic controller reads `dead()` at its step boundaries and
polls, and its recovery agrees in `store` (megadyn/elastic/recovery/agreement.py).

Starting the watch declares that this attempt's workers recover in-process
(`failures.declare_recovering`): from then on the agent keeps the survivors running. Under
`--coordinator` the thread's client reconnects when a coordinator comes back (store_client.py):
it declares that again in the empty store and reads the failure records from a count of 0 (the
agents publish theirs again); the agreement's client waits for the coordinator while it is down.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch.distributed as dist

from megadyn.core import c10d_compat
from megadyn.launch import failures, torchrun_env
from megadyn.launch.console import print_line
from megadyn.launch.distributed_init import agent_store, attempt_prefix
from megadyn.launch.store_client import ReconnectingStore


class FailureWatch:
    """The failure records of this attempt, read by a daemon thread (a `FailureFeed`)."""

    def __init__(
        self,
        store,
        world: int,
        timeout_s: float,
        interval: float,
        on_failure=None,
        abort_nccl: bool = False,
        abort_deadline_s: float = 30.0,
        abort_exit: int = 1,
        on_revive=None,
    ):
        self.store, self.world, self.timeout_s = store, world, timeout_s
        self.interval, self.on_failure, self.abort_nccl = interval, on_failure, abort_nccl
        self.abort_deadline_s, self.abort_exit = abort_deadline_s, abort_exit
        self.trainer = None  # the runtime's current trainer (its last step's CUDA event)
        self.device_done: int | None = None  # set when the NCCL communicators are aborted
        self._dead: dict[int, float] = {}
        self._dismissed: dict[int, float] = {}  # rank -> the time of its record that is past
        self.on_revive = on_revive
        self._seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megadyn-failures", daemon=True)
        # the agreement's client: the thread keeps one of its own
        client = agent_store(timedelta(seconds=30))
        self._reader = dist.PrefixStore(
            attempt_prefix(torchrun_env.current().restart_count or 0), client
        )
        if isinstance(client, ReconnectingStore):
            client.on_reconnect.append(self._coordinator_back)
        if os.environ.get("MEGADYN_REJOIN"):  # a replacement's worker: the records before it
            self._dismissed = {r: f.time for r, f in failures.read(self._reader, world).items()}

    @classmethod
    def start(
        cls,
        timeout_s: float,
        interval: float = 0.05,
        on_failure=None,
        abort_nccl: bool = False,
        **abort,
    ) -> FailureWatch | None:
        """Declare in-process recovery and start watching; None unless the launcher keeps
        survivors (plain torchrun stops every worker when one fails). With `abort_nccl` a
        failure aborts the NCCL communicators (`abort_nccl_groups`), after noting the last
        step of `trainer` whose device work had finished (`device_done`); `abort` sets
        `abort_deadline_s` and `abort_exit` (see `_abort_within_deadline`)."""
        env = torchrun_env.current()
        if env.restart_count is None or not env.keep_survivors:
            return None
        store = dist.PrefixStore(
            attempt_prefix(env.restart_count), agent_store(timedelta(seconds=60))
        )
        watch = cls(
            store, dist.get_world_size(), timeout_s, interval, on_failure, abort_nccl, **abort
        )
        failures.declare_recovering(store)
        watch._thread.start()
        return watch

    def dead(self) -> dict[int, float]:
        return dict(self._dead)

    def revive(self, ranks) -> None:
        """`ranks` run again in a replacement host's processes (megadyn/launch/rejoin.py):
        their records so far are dismissed; a later record (a new time) counts."""
        for rank in ranks:
            if rank in self._dead:
                self._dismissed[rank] = self._dead.pop(rank)
        if self.on_revive is not None:
            self.on_revive(ranks)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _coordinator_back(self) -> None:
        """A coordinator came back with an empty store (the thread's own call reconnected)."""
        failures.declare_recovering(self._reader)
        self._seen = 0

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                count = self._reader.add(failures.COUNT_KEY, 0)
                if count <= self._seen:
                    continue
                records = failures.read(self._reader, self.world)
            except Exception:  # noqa: BLE001 - the store did not answer this time
                continue
            self._seen = count
            new = {
                r: f.time
                for r, f in records.items()
                if r not in self._dead and f.time != self._dismissed.get(r)
            }
            if not new:
                continue
            if self.abort_nccl:
                self.device_done = self._device_done()
                if self.trainer is not None:
                    self.trainer.interrupt()  # before the abort lets its collectives return
                self._abort_within_deadline(sorted(new))
            self._dead.update(new)
            if self.on_failure is not None:
                self.on_failure(set(new))

    def _abort_within_deadline(self, dead: list[int]) -> None:
        """Abort the NCCL communicators; a survivor whose abort does not return within
        `abort_deadline_s` cannot recover in-process: it exits with `abort_exit` (the job's
        restart path) instead of waiting on its communicators' own timeout."""
        rank = dist.get_rank()

        def stuck() -> None:
            print_line(
                f" failure watch: rank {rank}: aborting the NCCL communicators after rank(s) "
                f"{dead} failed did not return in {self.abort_deadline_s:g} s; exiting with "
                f"status {self.abort_exit} so that the restart path takes over",
                flush=True,
            )
            os._exit(self.abort_exit)

        timer = threading.Timer(self.abort_deadline_s, stuck)
        timer.daemon = True
        timer.start()
        try:
            abort_nccl_groups()
        finally:
            timer.cancel()

    def _device_done(self) -> int:
        """The last step of the current trainer whose device work has finished."""
        trainer = self.trainer
        if trainer is None:
            return 0
        iteration, done = trainer.iteration, trainer.step_done
        return iteration if done is None or done.query() else iteration - 1


def abort_nccl_groups() -> None:
    """On NCCL a collective that waits on a dead rank does not return: abort the communicator
    of every group but the default one (the recovery destroys them all and builds new ones).
    The aborts run at once, one thread per group: a communicator's abort synchronizes its own
    stream, which may wait behind another group's kernel that still waits on the dead rank, so
    aborted one after another (or inside one NCCL group call) the first abort never returns;
    started together, every communicator's abort flag is set before any of them waits, every
    kernel ends and every abort returns (0.5 s on 2 x H200, torch 2.11, NCCL 2.28).
    Run with TORCH_NCCL_ASYNC_ERROR_HANDLING=0, so that NCCL's watchdog leaves the process up."""
    groups = c10d_compat.nccl_groups()
    threads = [threading.Thread(target=_abort_quietly, args=(g,), daemon=True) for g in groups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _abort_quietly(group) -> None:
    try:
        c10d_compat.abort_group(group)
    except Exception:  # noqa: BLE001 - destroyed meanwhile by the main thread
        pass
