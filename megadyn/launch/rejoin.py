"""A replacement host joins a running job: its workers take a lost host's ranks again, the
survivors keep their processes, and the job grows back to its first layout.

    python -m megadyn.launch --coordinator HOST:PORT --nnodes 2 --nproc-per-node 8 \\
        --rdzv-id job1 --replace-lost-host pretrain_gpt.py <the job's flags>     # replacement.py

The replacement agent does not enter torchrun's rendezvous (the survivors' agents would restart
their workers to admit it). It claims a lost host's slot in the coordinator's store, once
(`claim`), and starts that slot's global ranks with MEGADYN_REJOIN=k, k the job's rejoin epoch.
In the attempt's key space of the store (distributed_init.attempt_prefix):

    rejoin/epochs       counter: the k of each claim
    rejoin/<k>/slot     JSON Slot: the node rank and global ranks the replacement took
    rejoin/<k>/ready    counter: its workers waiting to join
    rejoin/<k>/info     JSON from the survivors' leader: the group count, the controller's
                        epoch, live processes, layout members and the control store's host
    rejoin/<k>/         the key space of the default process group of epoch k
    rejoin/closed       the job finished: a replacement's workers that wait exit (status 0)

The survivors' leader sees every worker of the slot ready at a step boundary (`Rejoins.offer`),
publishes `info` and a reconfiguration (event "rejoin") to the job's first layout over every
rank. Every process then forms a new default group in epoch k's key space
(`Rejoins.reform`: same ranks and world size; the old default group, with the dead processes
in it, is dropped: c10d_compat.replace_default_group) and runs that transition, the newcomers
as standby processes that join: the reshard plan reads from the survivors only. The newcomers
form the same group at their start (`join_default_group`), once `info` is there.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch.distributed as dist

from megadyn.core import c10d_compat
from megadyn.launch import hosts, torchrun_env
from megadyn.launch.console import print_line
from megadyn.launch.distributed_init import agent_store, attempt_prefix

REJOIN_ENV = "MEGADYN_REJOIN"
"""The rejoin epoch k in a replacement's workers' environment (replacement.py)."""
EPOCHS_KEY = "rejoin/epochs"
CLOSED_KEY = "rejoin/closed"
"""Set by the survivors' leader when the job finished: a replacement that comes later exits."""


def slot_key(k: int) -> str:
    return f"rejoin/{k}/slot"


def ready_key(k: int) -> str:
    return f"rejoin/{k}/ready"


def info_key(k: int) -> str:
    return f"rejoin/{k}/info"


def group_prefix(k: int) -> str:
    """The key space of epoch k's default group, inside the attempt's."""
    return f"rejoin/{k}/"


@dataclass(frozen=True)
class Slot:
    """A lost host's place in the job, taken by a replacement in rejoin epoch `epoch`."""

    epoch: int
    group_rank: int
    ranks: tuple[int, ...]
    host: str
    nnodes: int
    """The job's host slots."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text) -> Slot:
        d = json.loads(text)
        return cls(d["epoch"], d["group_rank"], tuple(d["ranks"]), d["host"], d["nnodes"])


def claim(store, nnodes: int, nproc: int, host: str) -> Slot | None:
    """The replacement agent's side: the first lost, unclaimed host slot among `nnodes`, claimed
    for this agent (compare_set: two replacements never take one slot); None when none is."""
    for g in range(nnodes):
        if not store.check([hosts.host_key(g)]):
            continue
        beat = hosts.Beat.from_json(g, store.get(hosts.host_key(g)))
        fence = hosts.lost_key(g, beat.incarnation)
        if not store.check([fence]):
            continue
        token = f"{host}/{os.getpid()}/{time.time()}"
        if store.compare_set(fence + "/replaced", "", token).decode() != token:
            continue  # another replacement took it
        k = store.add(EPOCHS_KEY, 1)
        ranks = tuple(range(g * nproc, (g + 1) * nproc))  # torchrun's ranks of that node
        slot = Slot(k, g, ranks, host, nnodes)
        store.set(slot_key(k), slot.to_json())
        return slot
    return None


def rejoin_epoch() -> int | None:
    """This worker's rejoin epoch (a replacement's worker), else None."""
    value = os.environ.get(REJOIN_ENV)
    return int(value) if value else None


def _attempt_store(timeout: timedelta, wait_s: float | None = None) -> dist.Store:
    restart = torchrun_env.current().restart_count or 0
    return dist.PrefixStore(attempt_prefix(restart), agent_store(timeout, wait_s))


def join_default_group(k: int, backend: str, timeout: timedelta) -> None:
    """A replacement's worker: say it is ready, wait for the survivors' `info` (they publish
    it at a step boundary), and form epoch k's default group with them."""
    env, store = torchrun_env.current(), _attempt_store(timeout)
    store.add(ready_key(k), 1)
    while not store.check([info_key(k)]):
        if store.check([CLOSED_KEY]):
            print_line(f" rejoin: rank {env.rank}: the job finished before it could join")
            raise SystemExit(0)
        time.sleep(0.05)
    info = json.loads(store.get(info_key(k)))
    c10d_compat.raise_group_count(info["group_count"])
    group_store = dist.PrefixStore(group_prefix(k), store)
    dist.init_process_group(
        backend, store=group_store, rank=env.rank, world_size=env.world_size, timeout=timeout
    )


def joined_info(k: int) -> dict:
    """A replacement's worker, once in the group: what the survivors' leader published."""
    return json.loads(_attempt_store(timedelta(seconds=60)).get(info_key(k)))


@dataclass(frozen=True)
class Offer:
    """Replacement workers ready to join: rejoin epoch, their ranks, the layout to grow to."""

    epoch: int
    ranks: tuple[int, ...]
    layout: object
    members: tuple[int, ...]


class Rejoins:
    """The survivors' side (the elastic controller's `rejoins`): offers of replacement
    workers at step boundaries, and the default group formed anew with them."""

    def __init__(self, target: Callable[[], tuple[object, list[int]]], timeout: timedelta):
        """`target()`: the job's first layout and its members over every rank."""
        self.target, self.timeout = target, timeout
        self.store = _attempt_store(timedelta(seconds=60))
        # read at step boundaries: fails at once while the coordinator is away
        self._polled = _attempt_store(timedelta(seconds=60), wait_s=0)
        self.formed = rejoin_epoch() or 0  # the newest epoch whose default group this has

    def offer(self, live: list[int]) -> Offer | None:
        """The leader: the next epoch's workers, once every one of them is ready and the
        processes they replace are gone from `live`; None otherwise."""
        k, store = self.formed + 1, self._polled
        try:
            if not store.check([slot_key(k)]):
                return None
            slot = Slot.from_json(store.get(slot_key(k)))
            ready = store.add(ready_key(k), 0)
        except Exception:  # noqa: BLE001 - the coordinator is away: training goes on
            return None
        if ready < len(slot.ranks) or set(slot.ranks) & set(live):
            return None
        if len(set(live) | set(slot.ranks)) != dist.get_world_size():
            return None  # the first layout needs every rank (another host is still lost)
        layout, members = self.target()
        return Offer(k, slot.ranks, layout, tuple(members))

    def publish(self, k: int, info: dict) -> None:
        """The leader: what the newcomers read before they form the group."""
        info = {**info, "group_count": c10d_compat.group_count()}
        self.store.set(info_key(k), json.dumps(info))

    def close(self) -> None:
        """The leader, at the job's end: replacements that wait to join exit."""
        self.store.set(CLOSED_KEY, "1")

    def reform(self, k: int) -> None:
        """Every survivor: epoch k's default group, with the newcomers (a no-op on a newcomer,
        which formed it at its start)."""
        if k <= self.formed:
            return
        env = torchrun_env.current()
        c10d_compat.replace_default_group(
            dist.get_backend(),
            dist.PrefixStore(group_prefix(k), self.store),
            env.rank,
            env.world_size,
            self.timeout,
            count=c10d_compat.group_count(),
        )
        self.formed = k
