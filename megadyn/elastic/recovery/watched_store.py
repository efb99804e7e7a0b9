"""Process-group creation that notices a failure: the store it reads watches the failure records.

    failed = lambda: bool(set(feed.dead()) - seen)     # another process was recorded dead
    with watching_failures(failed):
        group = dist.new_group(ranks, timeout=connect)  # raises PeerGone soon after one more dies

Creating a process group connects its members through the job's default store: gloo's full
mesh waits there for each peer's address, NCCL's first use for its communicator's id. A peer
that dies before it published its address is waited for until the group's timeout, however
early the agent recorded its death (a survivor of a failure waited 60 s in the recovery's
group creation for a second survivor that had died 0.1 s after the first; issue 20). Inside
`watching_failures` the default store is a `WatchedStore`: its blocking waits poll the store
and `failed()`, and raise PeerGone as soon as `failed()` is true, so the recovery starts its
agreement over (recovery/recovery.py) instead of waiting out the timeout.

Groups created inside keep the `WatchedStore` as their store; outside the block it only passes
calls on (an NCCL communicator's first use, after the block, waits as it would without it).

Two rules keep that safe, because C++ (the groups' PrefixStores) holds only the C++ half of a
Python store, and calls a method of the Python half by name:
- every `WatchedStore` (clones included) stays referenced for the life of the process
  (`c10d_compat.keep_python_store`). On gloo a group connects inside the block, while the block still held the store; an
  NCCL group connects at its first collective, after the block: with nothing left holding the
  Python half, its `set` failed with "fn INTERNAL ASSERT FAILED ... Not implemented." and every
  recovery on GPUs ended in the restart path (tests/elastic/test_watched_store.py reproduces
  that path on gloo);
- it overrides every method of `dist.Store`, so no call falls through to the base class's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from megadyn.core import c10d_compat
from megadyn.elastic.recovery.agreement import poll


class PeerGone(RuntimeError):
    """Another process failed while this one waited for a peer in the store."""


class _Watch:
    """Whether a `WatchedStore` (and its clones) watch `failed` now."""

    def __init__(self, failed: Callable[[], bool]):
        self.failed, self.on = failed, True


class WatchedStore(dist.Store):
    """`inner`, whose waits (wait, get, multi_get) also end when the watch's `failed()` is
    true, while the watch is on."""

    def __init__(self, inner: dist.Store, watch: _Watch):
        super().__init__()
        self.inner, self.watch = inner, watch
        super().set_timeout(inner.timeout)
        c10d_compat.keep_python_store(self)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        timeout = self.timeout if timeout is None else timeout
        if not self.watch.on:
            self.inner.wait(keys, timeout)
            return

        def ready():
            if self.inner.check(keys):
                return True
            if self.watch.failed():
                raise PeerGone(f"another process failed while this one waited for {keys}")
            return None

        if poll(ready, timeout.total_seconds(), interval=0.05, first=0.002) is None:
            raise dist.DistStoreError(f"wait timeout after {timeout}, keys: {keys}")

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.inner.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        return self.inner.multi_get(keys)

    def set(self, key: str, value) -> None:
        self.inner.set(key, value)

    def multi_set(self, keys: list[str], values: list) -> None:
        self.inner.multi_set(keys, values)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def append(self, key: str, value) -> None:
        self.inner.append(key, value)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def has_extended_api(self) -> bool:
        return self.inner.has_extended_api()

    def queue_push(self, key: str, value) -> None:
        self.inner.queue_push(key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self.inner.queue_pop(key, block)

    def queue_len(self, key: str) -> int:
        return self.inner.queue_len(key)

    def list_keys(self) -> list[str]:
        return self.inner.list_keys()

    def barrier(self) -> None:
        self.inner.barrier()

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self.inner.set_timeout(timeout)

    def clone(self) -> WatchedStore:
        return WatchedStore(self.inner.clone(), self.watch)


@contextmanager
def watching_failures(failed: Callable[[], bool]) -> Iterator[None]:
    """Inside: process groups are created through a `WatchedStore` over the default store."""
    watch = _Watch(failed)
    try:
        with c10d_compat.default_store_replaced(WatchedStore(c10d_compat.default_store(), watch)):
            yield
    finally:
        watch.on = False
