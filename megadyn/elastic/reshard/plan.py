"""The reshard planner: which rank sends which region of which tensor to whom (pure, no processes).

    plan = plan_reshard(cfg, old_layout, old_members, new_layout, new_members,
                        hosts={0: "a", 1: "a", 2: "b", 3: "b"}, old_distopt=True, new_distopt=True)
    plan.transfers          # [Transfer(src, dst, key, src_region, dst_region, nbytes)]
    plan.summary()          # bytes moved, largest per-rank send / receive, vs. the baseline

Every element of every piece that the new layout needs is delivered exactly once: for each new
piece the planner cuts the old pieces of the same tensor into *atoms* (disjoint regions, each
held by a set of replicas), intersects, and picks one source per fragment. A local copy
(src == dst) is taken whenever the new holder already has the fragment; otherwise fragments are
assigned largest first to the replica that keeps the largest per-rank send lowest, preferring a
source on the destination's host when that does not raise it. `plan.baseline` always reads from
the lowest-ranked holder; the plan is never worse than it (it falls back to lowest-ranked-with-
local-copies when the greedy choice would be).

`exclude` names old ranks that cannot send (a process that died): every fragment is then read
from another holder, a data-parallel copy of a weight or a replica of an optimizer shard
(--num-distributed-optimizer-instances), and a fragment that only excluded ranks hold is a
PlanError naming the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from megadyn.core.layout import Layout
from megadyn.elastic.reshard.description import DistOpt, HeldPiece, StateDescription, describe
from megadyn.elastic.reshard.regions import LocalRegion, flat_segments, intersect
from megadyn.models.config import GPTConfig


class PlanError(ValueError):
    """The new layout needs state that no old rank holds."""


@dataclass(frozen=True)
class Transfer:
    """Copy `src_region` of src's old local `key` into `dst_region` of dst's new local `key`."""

    src: int
    dst: int
    key: str
    src_region: LocalRegion
    dst_region: LocalRegion
    nbytes: int


@dataclass
class Plan:
    transfers: list[Transfer]
    old: StateDescription
    new: StateDescription
    strategy: str = "balanced"
    baseline: Plan | None = None
    hosts: Mapping[int, Hashable] | None = None
    send_bytes: dict[int, int] = field(init=False)
    recv_bytes: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        ranks = sorted(set(self.old.pieces) | set(self.new.pieces))
        self.send_bytes = dict.fromkeys(ranks, 0)
        self.recv_bytes = dict.fromkeys(ranks, 0)
        for t in self.transfers:
            if t.src != t.dst:
                self.send_bytes[t.src] += t.nbytes
                self.recv_bytes[t.dst] += t.nbytes

    @property
    def total_bytes(self) -> int:
        """Bytes sent between ranks (local copies excluded)."""
        return sum(self.send_bytes.values())

    @property
    def local_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers if t.src == t.dst)

    @property
    def max_send(self) -> int:
        return max(self.send_bytes.values(), default=0)

    @property
    def max_recv(self) -> int:
        return max(self.recv_bytes.values(), default=0)

    @property
    def cross_host_bytes(self) -> int:
        if self.hosts is None:
            return 0
        h = self.hosts
        return sum(t.nbytes for t in self.transfers if h.get(t.src) != h.get(t.dst))

    def summary(self) -> dict[str, object]:
        """What a reconfiguration logs: bytes moved and the largest per-rank load."""
        out = {
            "strategy": self.strategy,
            "transfers": len(self.transfers),
            "total_bytes": self.total_bytes,
            "local_bytes": self.local_bytes,
            "cross_host_bytes": self.cross_host_bytes,
            "max_send_bytes": self.max_send,
            "max_recv_bytes": self.max_recv,
        }
        if self.baseline is not None:
            out["baseline_max_send_bytes"] = self.baseline.max_send
        return out


class _Fragment(NamedTuple):
    """A region of one new piece that lies in one atom of the old pieces: what one Transfer
    delivers, before its source is chosen among the atom's holders."""

    key: str
    dst: int
    nbytes: int
    anchor: int
    """Flat index, in the old pieces' box, of the run the source reads from."""
    shape: tuple[int, ...]
    """Shape of that run."""
    index: tuple[tuple[int, int], ...]
    """The fragment's (start, end) per dimension of the run."""
    dst_region: LocalRegion
    holders: list[tuple[int, int]]
    """(rank, start of its flat range), sorted by rank; holder r reads
    LocalRegion(anchor - start, shape, index)."""


def _atoms(holders: list[tuple[int, int, int]]) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Disjoint intervals [a, b) of a rect's flattening, each with its holders (rank, start)."""
    points = sorted({s for _, s, _ in holders} | {e for _, _, e in holders})
    out = []
    for a, b in zip(points, points[1:]):
        hs = sorted((r, s) for r, s, e in holders if s <= a and b <= e)
        if hs:
            out.append((a, b, hs))
    return out


def _fragments(
    old: StateDescription, new: StateDescription, exclude: frozenset[int] = frozenset()
) -> list[_Fragment]:
    """Every (new rank, piece) cut into fragments that each lie in one atom of the pieces of
    the old ranks not in `exclude`."""
    rects: dict[str, dict[tuple, list[tuple[int, int, int]]]] = {}
    for rank, pieces in old.pieces.items():
        if rank in exclude:
            continue
        for p in pieces:
            if p.numel:
                rects.setdefault(p.key, {}).setdefault((p.offsets, p.sizes), []).append(
                    (rank, p.start, p.end)
                )
    atoms = {k: {r: _atoms(h) for r, h in by_rect.items()} for k, by_rect in rects.items()}
    segments: dict[tuple, list] = {}  # (key, rect, a, b) -> flat_segments, cached
    out: list[_Fragment] = []
    for dst, pieces in new.pieces.items():
        for p in pieces:
            if p.numel:
                itemsize = new.tensors[p.key].itemsize
                covered = _cut(p, dst, itemsize, atoms.get(p.key, {}), segments, p.key, out)
                if covered != p.numel:
                    gone = f" (ranks {sorted(exclude)} excluded)" if exclude else ""
                    raise PlanError(
                        f"{p.key}: rank {dst} needs {p.numel} elements but old ranks hold only "
                        f"{covered} of them{gone}"
                    )
    return out


def _cut(p: HeldPiece, dst: int, itemsize: int, atoms, segments, key, out) -> int:
    covered = 0
    rect_n = (p.offsets, p.sizes)
    new_segs = None
    for rect_o, rect_atoms in atoms.items():
        if rect_o == rect_n:  # same box: intervals of one flattening
            for a, b, hs in rect_atoms:
                lo, hi = max(a, p.start), min(b, p.end)
                if lo < hi:
                    n = hi - lo
                    dst_region = LocalRegion(lo - p.start, (n,), ((0, n),))
                    out.append(
                        _Fragment(key, dst, n * itemsize, lo, (n,), ((0, n),), dst_region, hs)
                    )
                    covered += n
            continue
        if intersect(*rect_o, *rect_n) is None:
            continue
        if new_segs is None:
            new_segs = flat_segments(p.start, p.end, p.offsets, p.sizes)
        for a, b, hs in rect_atoms:
            cache_key = (key, rect_o, a, b)
            if cache_key not in segments:
                segments[cache_key] = flat_segments(a, b, *rect_o)
            for os in segments[cache_key]:
                for ns in new_segs:
                    box = intersect(os.origin, os.shape, ns.origin, ns.shape)
                    if box is None:
                        continue
                    origin, shape = box
                    src_index = tuple(
                        (o - s, o - s + n) for o, s, n in zip(origin, os.origin, shape)
                    )
                    dst_index = tuple(
                        (o - s, o - s + n) for o, s, n in zip(origin, ns.origin, shape)
                    )
                    dst_region = LocalRegion(ns.flat_start - p.start, ns.shape, dst_index)
                    n = math.prod(shape)
                    out.append(
                        _Fragment(
                            key,
                            dst,
                            n * itemsize,
                            os.flat_start,
                            os.shape,
                            src_index,
                            dst_region,
                            hs,
                        )
                    )
                    covered += n
    return covered


def _assign(fragments: list[_Fragment], choose) -> list[Transfer]:
    """One Transfer per fragment, sources picked by `choose(fragment)` largest first."""
    order = sorted(range(len(fragments)), key=lambda i: -fragments[i].nbytes)
    chosen: list[Transfer | None] = [None] * len(fragments)
    for i in order:
        f = fragments[i]
        src, start = choose(f)
        src_region = LocalRegion(f.anchor - start, f.shape, f.index)
        chosen[i] = Transfer(src, f.dst, f.key, src_region, f.dst_region, f.nbytes)
    return chosen  # in fragment order: key by key, as the new description lists them


def _balanced_chooser(hosts: Mapping[int, Hashable] | None):
    load: dict[int, int] = {}
    state = {"max": 0}

    def choose(fragment: _Fragment) -> tuple[int, int]:
        dst, nbytes, hs = fragment.dst, fragment.nbytes, fragment.holders
        for r, s in hs:
            if r == dst:
                return r, s
        least = min(load.get(r, 0) for r, _ in hs)
        limit = max(state["max"], least + nbytes)  # choices that keep the largest send

        def score(h: tuple[int, int]) -> tuple:
            r = h[0]
            same = hosts is not None and hosts.get(r) == hosts.get(dst)
            return (load.get(r, 0) + nbytes > limit, not same, load.get(r, 0), r)

        r, s = min(hs, key=score)
        load[r] = load.get(r, 0) + nbytes
        state["max"] = max(state["max"], load[r])
        return r, s

    return choose


def _lowest(prefer_local: bool):
    def choose(fragment: _Fragment) -> tuple[int, int]:
        dst, hs = fragment.dst, fragment.holders
        if prefer_local:
            for r, s in hs:
                if r == dst:
                    return r, s
        return hs[0]  # holders are sorted by rank

    return choose


def plan_between(
    old: StateDescription,
    new: StateDescription,
    hosts: Mapping[int, Hashable] | None = None,
    exclude: Collection[int] = (),
) -> Plan:
    """The reshard plan from one described state to another, reading nothing from the old
    ranks in `exclude`."""
    fragments = _fragments(old, new, frozenset(exclude))
    baseline = Plan(_assign(fragments, _lowest(False)), old, new, "lowest-rank", hosts=hosts)
    plan = Plan(_assign(fragments, _balanced_chooser(hosts)), old, new, "balanced", hosts=hosts)
    if plan.max_send > baseline.max_send:
        plan = Plan(_assign(fragments, _lowest(True)), old, new, "lowest-rank-local", hosts=hosts)
    plan.baseline = baseline
    return plan


def plan_reshard(
    cfg: GPTConfig,
    old_layout: Layout,
    old_members: Sequence[int],
    new_layout: Layout,
    new_members: Sequence[int],
    *,
    hosts: Mapping[int, Hashable] | None = None,
    old_distopt: DistOpt | bool | None = None,
    new_distopt: DistOpt | bool | None = None,
    exclude: Collection[int] = (),
    **describe_kwargs,
) -> Plan:
    """Plan the move of the whole training state from one layout to another (sources other
    than the old ranks in `exclude`)."""
    old = describe(cfg, old_layout, old_members, distopt=old_distopt, **describe_kwargs)
    new = describe(cfg, new_layout, new_members, distopt=new_distopt, **describe_kwargs)
    return plan_between(old, new, hosts, exclude)
