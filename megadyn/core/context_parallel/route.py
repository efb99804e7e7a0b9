"""What one cp rank's dynamic attention (dynamic.py) derives from a micro batch's placement:
which blocks it exchanges with whom, and its queries as varlen segments. The same in every
layer, so derived once per micro batch (kept in BlockPlacement.derived).

    route = derive_route(placement, rank, host_ids, batch, device)

Everything is kept as runs, (start, length) along one axis: with few runs (a window placement
holds at most two per rank) the copies between the rank's tokens, the whole sequence's keys
and the packed segments are a few slice copies instead of gathers by index.

A segment is a run of the rank's query tokens that are consecutive in the sequence and of one
document; its keys run from that document's start to the run's end. Segments whose keys the
rank holds form the first part (computed while the received blocks are in flight), the others
the second.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megadyn.core.context_parallel.placement import BlockPlacement
from megadyn.core.context_parallel.varlen import VarlenPlan

Runs = tuple[tuple[int, int], ...]
"""(start, length) along one axis, in order."""


def merged(runs) -> Runs:
    """`runs` with each run that starts where the previous one ends joined to it."""
    out: list[list[int]] = []
    for start, length in runs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1][1] += length
        else:
            out.append([start, length])
    return tuple((a, n) for a, n in out)


def take(x: torch.Tensor, dim: int, runs: Runs) -> torch.Tensor:
    """x's `runs` along `dim`, one after another (one contiguous copy)."""
    pieces = [x.narrow(dim, a, n) for a, n in runs]
    return pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces, dim)


def put(dst: torch.Tensor, dim: int, runs: Runs, src: torch.Tensor, add: bool = False) -> None:
    """Copy (or add) src's consecutive pieces along `dim` into dst's `runs`."""
    at = 0
    for a, n in runs:
        piece = src.narrow(dim, at, n)
        target = dst.narrow(dim, a, n)
        target.add_(piece) if add else target.copy_(piece)
        at += n


@dataclass(frozen=True)
class Part:
    """One varlen call over some of the rank's segments."""

    plan: VarlenPlan
    rows: Runs
    """Its query rows: runs of the rank's tokens flattened over the micro batch ([b * s])."""
    keys: Runs
    """Its keys, segment after segment: runs of the whole sequence flattened ([b * S])."""


@dataclass(frozen=True)
class Route:
    seq: int
    own: Runs
    """Runs of the sequence positions the rank holds (its local order is theirs)."""
    sends: dict
    """{peer: runs of the rank's local rows that peer reads}."""
    receives: dict
    """{peer: runs of sequence positions received from it, in the message's order}."""
    parts: tuple
    """(segments on the rank's own keys, the rest): Part or None each."""


def _needs(placement: BlockPlacement, rank: int) -> list[int]:
    """Key blocks of other ranks that `rank`'s pairs read, increasing."""
    own = set(placement.blocks[rank])
    return sorted({k for _, k in placement.pairs(rank) if k not in own})


def _exchange(placement: BlockPlacement, rank: int):
    """(sends, receives): {peer: [blocks]} this rank sends of its own, and receives; every
    rank computes the same plan."""
    owner = {k: r for r, held in enumerate(placement.blocks) for k in held}
    sends = {}
    for peer in range(placement.cp):
        wanted = [k for k in _needs(placement, peer) if owner[k] == rank] if peer != rank else []
        if wanted:
            sends[peer] = wanted
    receives = {}
    for k in _needs(placement, rank):
        receives.setdefault(owner[k], []).append(k)
    return sends, receives


def _segments(placement: BlockPlacement, rank: int, ids: torch.Tensor):
    """(sample row, first local row, end local row, first key, end key) of each segment of
    `rank` (module docstring). `ids` [b, S] on the host."""
    seq = ids.shape[1]
    pos = placement.token_index(rank)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    doc_start = torch.where(starts, torch.arange(seq), 0).cummax(-1).values  # [b, S]
    for row in range(ids.shape[0]):
        mine = ids[row, pos]
        cut = torch.ones(pos.numel(), dtype=torch.bool)
        cut[1:] = (pos[1:] != pos[:-1] + 1) | (mine[1:] != mine[:-1])
        bounds = cut.nonzero().flatten().tolist() + [pos.numel()]
        for a, e in zip(bounds, bounds[1:]):
            yield row, a, e, doc_start[row, pos[a]].item(), pos[e - 1].item() + 1


def derive_route(placement: BlockPlacement, rank: int, ids, batch: int, device) -> Route:
    """`rank`'s route; `ids` [b, S] on the host, or None (one document: causal over the
    whole sequence)."""
    n, held = placement.block_size, placement.blocks[rank]
    seq, local = placement.seq_length, len(held) * n
    if ids is None:
        ids = torch.zeros(batch, seq, dtype=torch.long)
    own = set(held)
    split = ([], [], []), ([], [], [])  # per part: query lengths, key lengths, (rows, keys)
    for row, a, e, first, last in _segments(placement, rank, ids):
        remote = any(k not in own for k in range(first // n, (last - 1) // n + 1))
        split[remote][0].append(e - a)
        split[remote][1].append(last - first)
        split[remote][2].append(((row * local + a, e - a), (row * seq + first, last - first)))
    parts = []
    for q_len, k_len, runs in split:
        if not q_len:
            parts.append(None)
            continue
        plan = VarlenPlan.build(q_len, k_len, device)
        parts.append(Part(plan, merged(r for r, _ in runs), merged(k for _, k in runs)))
    sends, receives = _exchange(placement, rank)
    slot = {k: i for i, k in enumerate(held)}
    return Route(
        seq,
        merged((k * n, n) for k in held),
        {p: merged((slot[k] * n, n) for k in blocks) for p, blocks in sends.items()},
        {p: merged((k * n, n) for k in blocks) for p, blocks in receives.items()},
        tuple(parts),
    )
