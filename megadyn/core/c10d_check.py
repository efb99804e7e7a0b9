"""The self-test of megadyn/core/c10d_compat.py: each function used for real, its effect checked.

    python -m megadyn.core.c10d_compat                                  # 1 process, gloo
    torchrun --nproc-per-node 2 -m megadyn.core.c10d_compat --backend nccl

Prints `c10d_compat: <function>: ok` or `... FAILED: <why>` per function (rank 0), then one
summary line naming torch's version; exits 1 if any check failed on any rank.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import torch
import torch.distributed as dist

from megadyn.core import c10d_compat as compat


class _CountingStore(dist.Store):
    """A Python store over `inner` that counts the calls torch's groups make through it."""

    def __init__(self, inner: dist.Store):
        super().__init__()
        self.inner, self.calls = inner, 0
        self.set_timeout(inner.timeout)

    def _pass(self, name: str, *args):
        self.calls += 1
        return getattr(self.inner, name)(*args)

    def set(self, key, value):
        return self._pass("set", key, value)

    def get(self, key):
        return self._pass("get", key)

    def add(self, key, amount):
        return self._pass("add", key, amount)

    def wait(self, keys, timeout=None):
        return self._pass("wait", keys, *([] if timeout is None else [timeout]))

    def check(self, keys):
        return self._pass("check", keys)

    def multi_get(self, keys):
        return self._pass("multi_get", keys)

    def multi_set(self, keys, values):
        return self._pass("multi_set", keys, values)

    def compare_set(self, key, expected, desired):
        return self._pass("compare_set", key, expected, desired)

    def delete_key(self, key):
        return self._pass("delete_key", key)

    def num_keys(self):
        return self._pass("num_keys")

    def append(self, key, value):
        return self._pass("append", key, value)

    def has_extended_api(self):
        return self.inner.has_extended_api()


def _expect(ok: bool, why: str) -> None:
    if not ok:
        raise AssertionError(why)


def _touch(group, device) -> None:
    """One all-reduce on `group` (NCCL builds its communicator here)."""
    t = torch.ones(1, device=device)
    dist.all_reduce(t, group=group)
    _expect(t.item() == dist.get_world_size(group), f"all-reduce gave {t.item()}")


# the functions of c10d_compat that the checks below use for real, one check each
NAMES = (
    "default_store",
    "group_store",
    "live_groups",
    "default_store_replaced",
    "group_count",
    "set_group_timeout",
    "abort_group",
    "symmetric_memory",
    "set_sm_carveout",
    "rendezvous_state_refreshed",
    "replace_default_group",
)


def _checks(device: torch.device) -> dict[str, Callable[[], None]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    ranks = list(range(world))
    kept = []  # Python stores that groups still use

    def default_store():
        store = compat.default_store()
        store.set(f"c10d_check/{rank}", str(rank))
        dist.barrier()
        got = [store.get(f"c10d_check/{r}") for r in ranks]
        _expect(got == [str(r).encode() for r in ranks], f"read back {got}")

    def group_store():
        g = dist.new_group(ranks)
        store = compat.group_store(g)
        store.set(f"mine/{rank}", b"x")
        _expect(store.get(f"mine/{rank}") == b"x", "a key set through it does not read back")
        _touch(g, device)

    def live_groups():
        g = dist.new_group(ranks)
        groups = compat.live_groups()
        _expect(g in groups and compat.default_group() in groups, "a new group is not listed")
        nccl = compat.nccl_groups()
        _expect(compat.default_group() not in nccl, "the default group is listed as NCCL's")
        _expect((g in nccl) == (dist.get_backend(g) == "nccl"), "NCCL groups misread")

    def default_store_replaced():
        original = compat.default_store()
        store = _CountingStore(original)
        kept.append(store)
        with compat.default_store_replaced(store):
            g = dist.new_group(ranks)
        _expect(compat.default_store() is original, "the default store was not put back")
        _touch(g, device)  # NCCL's first use reads the replaced store after the block
        _expect(world == 1 or store.calls > 0, "the new group never used the replaced store")

    def group_count():
        n = compat.group_count()
        dist.new_group(ranks)
        _expect(compat.group_count() == n + 1, f"{n} -> {compat.group_count()} after a group")
        compat.raise_group_count(n + 5)
        _expect(compat.group_count() == n + 5, "raise_group_count did not raise the count")
        g = dist.new_group(ranks)
        _touch(g, device)  # every rank drew the same name, or this hangs

    def set_group_timeout():
        g = dist.new_group(ranks, timeout=timedelta(seconds=30))
        compat.set_group_timeout(g, timedelta(minutes=5))
        _touch(g, device)

    def abort_group():
        g = dist.new_group(ranks)
        _touch(g, device)
        compat.abort_group(g)

    def symmetric_memory():
        symm_mem = compat.symmetric_memory()
        if device.type == "cuda" and world > 1:
            g = dist.new_group(ranks)
            t = symm_mem.empty(64, dtype=torch.uint8, device=device)
            handle = symm_mem.rendezvous(t, g.group_name)
            _expect(handle.get_buffer(0, (8,), torch.uint8).numel() == 8, "no buffer view")

    def set_sm_carveout():
        if device.type == "cuda":
            compat.set_sm_carveout(None)
        else:  # the CPU build has the name too
            _expect(hasattr(torch._C, "_set_sm_carveout_experimental"), "missing")

    def rendezvous_state_refreshed():
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

        state = rdzv._RendezvousState()
        node = rdzv._NodeDesc("host", 1, 0)
        state.participants[node] = 0
        state.last_heartbeats[node] = datetime.now(timezone.utc) - timedelta(hours=1)
        fresh = pickle.loads(compat.rendezvous_state_refreshed(pickle.dumps(state)))
        age = datetime.now(timezone.utc) - fresh.last_heartbeats[node]
        _expect(age < timedelta(minutes=1), f"the keep-alive time is {age} old")
        _expect(fresh.participants == {node: 0}, "the participants changed")

    def replace_default_group():  # last: the other checks use the first default group
        kept_group, old = dist.new_group(ranks), compat.default_group()
        store = dist.PrefixStore("c10d_check/replaced/", compat.default_store())
        n = compat.group_count() + 3
        compat.replace_default_group(
            dist.get_backend(), store, rank, world, timedelta(minutes=1), count=n
        )
        new = compat.default_group()
        _expect(new is not old and old not in compat.live_groups(), "the old group is listed")
        _expect((dist.get_rank(), dist.get_world_size()) == (rank, world), "rank or world moved")
        _expect(compat.group_count() == n + 1, f"group count {compat.group_count()}, not {n + 1}")
        _touch(new, device)
        _touch(kept_group, device)  # a group of the old default group still works
        _touch(dist.new_group(ranks), device)

    checks = {f.__name__: f for f in locals().values() if callable(f) and f is not _expect}
    return {name: checks[name] for name in NAMES}


def run_checks(device: torch.device) -> dict[str, str | None]:
    """Every check on this process: name -> None (passed) or the reason it failed."""
    results = {}
    for name, check in _checks(device).items():
        try:
            check()
            results[name] = None
        except Exception as e:  # noqa: BLE001 - each failure is reported by name
            results[name] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megadyn.core.c10d_compat", description=__doc__)
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    a = p.parse_args(argv)
    if "RANK" not in os.environ:  # one process of its own
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29591")
    device = torch.device("cpu")
    if a.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group(a.backend, timeout=timedelta(seconds=60))
    results = run_checks(device)
    failed = torch.tensor([sum(r is not None for r in results.values())], device=device)
    dist.all_reduce(failed)
    if dist.get_rank() == 0:
        for name, why in results.items():
            print(f"c10d_compat: {name}: " + ("ok" if why is None else f"FAILED: {why}"))
        verdict = "all passed" if failed.item() == 0 else f"{failed.item()} failed"
        print(
            f"c10d_compat: torch {torch.__version__}, {a.backend}, "
            f"{dist.get_world_size()} process(es): {verdict}",
            flush=True,
        )
    dist.destroy_process_group()
    return 0 if failed.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
