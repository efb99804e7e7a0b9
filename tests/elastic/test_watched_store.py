"""Group creation inside `watching_failures` ends when a failure is recorded
(megadyn/elastic/watched_store.py), on 2 gloo processes:

- with both processes present, a group is created through the watched store and works;
- rank 1 stays away from the next group's creation and, 0.5 s later, "records its failure" (a key
  that rank 0's `failed()` reads): rank 0's creation raises PeerGone soon after, though the
  group's timeout is 60 s;
- with nothing recorded, the group's own (1 s) timeout still ends the wait;
- outside the block, the default store is the job's again.
"""

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megadyn.elastic.watched_store import PeerGone, WatchedStore, watching_failures
from megadyn.testing import spawn


def _body(rank: int, world: int):
    store = dist.distributed_c10d._get_default_store()
    failed = lambda: store.check(["rank1/failed"])  # noqa: E731
    with watching_failures(failed):
        assert isinstance(dist.distributed_c10d._get_default_store(), WatchedStore)
        both = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    assert dist.distributed_c10d._get_default_store() is store
    x = torch.tensor([rank + 1.0])
    dist.all_reduce(x, group=both)
    assert x.item() == 3.0
    if rank == 1:  # away from the next group's creation, then recorded dead
        time.sleep(0.5)
        store.set("rank1/failed", "1")
        store.wait(["rank0/done"], timedelta(seconds=120))
        return None
    times = {}
    t0 = time.monotonic()
    try:
        with watching_failures(failed):
            dist.new_group([0, 1], timeout=timedelta(seconds=60))
        raise AssertionError("the group was created without rank 1")
    except PeerGone:
        times["failure"] = time.monotonic() - t0
    t0 = time.monotonic()
    try:
        with watching_failures(lambda: False):
            dist.new_group([0, 1], timeout=timedelta(seconds=1))
        raise AssertionError("the group was created without rank 1")
    except PeerGone:
        raise AssertionError("PeerGone without a failure") from None
    except RuntimeError:
        times["timeout"] = time.monotonic() - t0
    assert dist.distributed_c10d._get_default_store() is store
    store.set("rank0/done", "1")
    return times


def test_group_creation_ends_when_a_failure_is_recorded():
    times = spawn(_body, world=2)[0]
    assert times["failure"] < 20, times  # the group's timeout is 60 s
    assert 0.8 < times["timeout"] < 30, times
