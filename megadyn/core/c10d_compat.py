"""The private parts of torch.distributed that megadyn uses, in one place.

    from megadyn.core import c10d_compat

    c10d_compat.set_group_timeout(group, timedelta(minutes=10))
    with c10d_compat.default_store_replaced(watched):   # groups created inside use `watched`
        group = dist.new_group(ranks)

torch does not promise these names (`_world.pg_map`, `_world.group_count`, `_set_pg_timeout`,
`_get_default_store`, `ProcessGroup.abort`, `_symmetric_memory`, the SM carve-out, the keep-alive
times inside torchrun's pickled rendezvous state, the default group's replacement); every other
module reaches them only through the functions below. Each looks its name up when called and
raises `TorchChanged`, naming the torch version and what megadyn needed, when the name is gone.
The same checks run as one self-test on any machine, CPU (gloo) or GPUs (NCCL):

    python -m megadyn.core.c10d_compat                                  # 1 process, gloo
    torchrun --nproc-per-node 2 -m megadyn.core.c10d_compat --backend nccl

which prints one line per function and exits 1 if any fails (tests/core/test_c10d_compat.py
runs it on CPU; scripts/gpu/smoke.sh on the GPU machine's torch).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone

import torch
import torch.distributed as dist


class TorchChanged(RuntimeError):
    """A private torch part megadyn relies on is missing or behaves otherwise."""


def _c10d():
    return dist.distributed_c10d


_python_stores: list[dist.Store] = []


def keep_python_store(store: dist.Store) -> None:
    """Keep a Python subclass of `dist.Store` referenced for the life of the process. A process
    group holds its store through a C++ PrefixStore, which keeps only the C++ half of a Python
    store and calls its Python methods by name: once nothing in Python held the other half,
    NCCL's first use of a group (after the block that made it) failed with "fn INTERNAL ASSERT
    FAILED ... Not implemented." (megadyn/elastic/recovery/watched_store.py). Such a subclass
    must also override every method of `dist.Store`."""
    _python_stores.append(store)


def _require(owner, name: str, used_for: str):
    try:
        return getattr(owner, name)
    except AttributeError:
        where = getattr(owner, "__name__", type(owner).__name__)
        raise TorchChanged(
            f"torch {torch.__version__} has no {where}.{name}, which megadyn uses to {used_for} "
            "(megadyn/core/c10d_compat.py); use the torch version the project pins"
        ) from None


def _world():
    return _require(_c10d(), "_world", "reach the table of live process groups")


def _pg_map() -> dict:
    return _require(_world(), "pg_map", "reach the store and backend of each process group")


def default_group():
    """The default (world) process group."""
    return _require(_c10d(), "_get_default_group", "find the default group")()


def default_store() -> dist.Store:
    """The store the default group was created with (the job's rendezvous store)."""
    return _require(_c10d(), "_get_default_store", "reach the job's store")()


def group_store(group) -> dist.Store:
    """The store `group` was created with (NCCL reads it again at its communicator's first
    use, after the group's creation returned)."""
    return _pg_map()[group][1]


def live_groups() -> list:
    """Every process group torch holds, the default one included."""
    return list(_pg_map())


def nccl_groups() -> list:
    """Every NCCL group but the default one."""
    default = default_group()
    return [g for g in live_groups() if g is not default and dist.get_backend(g) == "nccl"]


@contextmanager
def default_store_replaced(store: dist.Store) -> Iterator[None]:
    """Inside: process groups are created over `store` instead of the default store (torch's
    new_group reads the default group's entry in the group table). Groups created inside keep
    `store` after the block: if it is a Python subclass of dist.Store, keep it referenced as
    long as they live (C++ holds only its C++ part)."""
    table, default = _pg_map(), default_group()
    backend, original = table[default]
    table[default] = (backend, store)
    try:
        yield
    finally:
        table[default] = (backend, original)


def group_count() -> int:
    """How many groups this process has created (torch names new groups by it)."""
    return _require(_world(), "group_count", "name process groups alike on every process")


def raise_group_count(n: int) -> None:
    """Name the next group as if at least `n` groups had been created."""
    world = _world()
    world.group_count = max(group_count(), n)


def set_group_timeout(group, timeout: timedelta) -> None:
    """Bound the later collectives of `group` by `timeout`."""
    _require(_c10d(), "_set_pg_timeout", "change a group's timeout after its creation")(
        timeout, group
    )


def abort_group(group) -> None:
    """Abort `group`'s communicators: its pending collectives end (NCCL: without waiting on a
    peer that died)."""
    _require(group, "abort", "abort the communicators of a failed layout")()


def replace_default_group(
    backend: str, store: dist.Store, rank: int, world_size: int, timeout: timedelta, count: int
) -> None:
    """A new default group over `store` (same rank and world size), named as if `count` groups
    had been created, in place of the old one, whose other groups stay as they are (a
    replacement host's processes join a running job: megadyn/launch/rejoin.py). torch's
    destroy_process_group() of the default group would destroy every group; here only the old
    default group's entries leave torch's tables (its sockets close when nothing refers to
    it). Every process of the new group calls this with the same `count`: torch names the
    default group by the group count, and its key space in the store by that name."""
    c10d, world = _c10d(), _world()
    old = default_group()
    for table in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config"):
        _require(world, table, "replace the default group").pop(old, None)
    tag = world.pg_to_tag.pop(old, None)
    for pgs in world.tags_to_pg.values() if tag is not None else ():
        if old in pgs:
            pgs.remove(old)
    world.pg_coalesce_state.pop(old, None)
    _require(c10d, "_unregister_process_group", "replace the default group")(old.group_name)
    _require(c10d, "_update_default_pg", "replace the default group")(None)
    world.group_count = count
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def symmetric_memory():
    """torch's symmetric-memory module (empty, rendezvous, the fused collectives' ops)."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        raise TorchChanged(
            f"torch {torch.__version__} has no torch.distributed._symmetric_memory, which "
            "megadyn's copy-engine transport uses (megadyn/core/c10d_compat.py)"
        ) from e
    for name in ("empty", "rendezvous"):
        _require(symm_mem, name, "allocate and exchange symmetric-memory workspaces")
    return symm_mem


def set_sm_carveout(sms: int | None) -> None:
    """Leave `sms` multiprocessors to the kernels beside the GEMMs (None: no carve-out)."""
    _require(torch._C, "_set_sm_carveout_experimental", "leave multiprocessors to NCCL")(sms)


def rendezvous_state_refreshed(state: bytes) -> bytes:
    """torchrun's rendezvous state (the pickled object its c10d rendezvous keeps in the store)
    with every node's keep-alive time set to now: published again after the coordinator's
    restart, times older than torchrun's keep-alive limit would drop every node of the job."""
    obj = pickle.loads(state)
    beats = _require(obj, "last_heartbeats", "publish the rendezvous anew")
    now = datetime.now(timezone.utc)
    for node, when in beats.items():
        beats[node] = now if when.tzinfo is not None else now.replace(tzinfo=None)
    return pickle.dumps(obj)


if __name__ == "__main__":
    import sys

    from megadyn.core.c10d_check import main

    sys.exit(main())
