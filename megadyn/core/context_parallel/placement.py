"""Dynamic context parallelism (--cp-placement dynamic): where each block of a micro batch's
sequence goes, chosen per micro batch so that every cp rank gets the same attention work.

The sequence of S tokens is cut into S / N blocks of N tokens (--cp-block-size). Every rank
gets S / (N cp) blocks (the same number of tokens, so everything but attention is balanced
by construction); which blocks is chosen from the work of each block's queries: the number of
keys each query sees (causal, and within its document under --reset-attention-mask), summed
over the block's tokens and the micro batch's samples. At cp 2 the first choice is a window:
rank 1 holds half the blocks in one run, rank 0 the two ends, the window slid until the work
balances (within WINDOW_SLACK), so that a rank holds at most two runs of blocks and its
queries read few runs of keys (dynamic.py). Otherwise blocks go, heaviest first, to the rank
with the least work that still has room; then swaps between the heaviest and the lightest rank
even out what is left. A rank holds its blocks in increasing order.

    placement = place_blocks(seq_length, block_size, cp, document_ids)   # document_ids [b, S]
    part = split_batch_dynamic(batch, cp_rank, placement)                 # [b, S] -> [b, S / cp]
    placement.token_index(cp_rank)                                        # their positions [S/cp]
    placement.pairs(cp_rank)                                              # the attention blocks

The placement depends on the document ids alone (read on the CPU), so every cp rank computes
the same one. `pairs` lists the (query block, key block) pairs that hold a visible
query/key pair, with their kind; route.py exchanges the key blocks they read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megadyn.core.context_parallel.sequence import SEQUENCE_KEYS, chunk_ids, local_positions


def token_work(seq_length: int, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[S] float64: how many keys each position's query sees, summed over the samples of
    `document_ids` [b, S] (its position within its document + 1); causal i + 1 without ids."""
    index = torch.arange(seq_length, dtype=torch.float64)
    if document_ids is None:
        return index + 1
    ids = document_ids.cpu()
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    start_of_doc = torch.where(starts, index.long(), 0).cummax(-1).values  # [b, S]
    return (index - start_of_doc + 1).sum(0).to(torch.float64)


def imbalance(work_per_rank: list[float]) -> float:
    """Largest relative distance of a rank's work from the mean (0: perfect balance)."""
    mean = sum(work_per_rank) / len(work_per_rank)
    return max(abs(w - mean) for w in work_per_rank) / mean


def static_work(seq_length: int, cp: int, document_ids=None) -> list[float]:
    """Attention work per rank of the static split (sequence.py's two chunks per rank)."""
    work = token_work(seq_length, document_ids)
    return [work[local_positions(seq_length, r, cp)].sum().item() for r in range(cp)]


@dataclass(frozen=True)
class BlockPlacement:
    """Which blocks of a micro batch's sequence each cp rank holds, and which attention
    blocks it computes."""

    block_size: int
    """Tokens per block N (--cp-block-size)."""
    blocks: tuple[tuple[int, ...], ...]
    """blocks[r]: the blocks cp rank r holds, increasing."""
    work: tuple[float, ...]
    """Attention work (visible query/key pairs) of each rank."""
    visible: torch.Tensor
    """[S / N, S / N] bool: query block q sees some key of key block k."""
    document_ids: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """The ids [b, S] it was computed from, on the host (None: causal over the sequence)."""
    derived: dict = field(default_factory=dict, compare=False, repr=False)
    """What is derived from the placement (its pairs, route.py's routes), computed at the
    first use and kept for the micro batch the placement belongs to."""

    @property
    def cp(self) -> int:
        return len(self.blocks)

    @property
    def seq_length(self) -> int:
        return self.visible.shape[0] * self.block_size

    def token_index(self, rank: int, device=None) -> torch.Tensor:
        """Positions [S / cp] of the tokens `rank` holds, in its local order."""
        n = self.block_size
        return torch.cat(
            [torch.arange(i * n, (i + 1) * n, device=device) for i in self.blocks[rank]]
        )

    def pairs(self, rank: int) -> list[tuple[int, int]]:
        """(local query block, key block) of `rank`: each of its query blocks with every key
        block holding a visible pair, in increasing order (computed once)."""
        key = ("pairs", rank)
        if key not in self.derived:
            i, k = self.visible[list(self.blocks[rank])].nonzero(as_tuple=True)
            self.derived[key] = list(zip(i.tolist(), k.tolist()))
        return self.derived[key]


def _loads(weights: list[float], blocks: list[list[int]]) -> list[float]:
    return [sum(weights[i] for i in held) for held in blocks]


def block_visibility(num_blocks: int, first=None, last=None) -> torch.Tensor:
    """[nb, nb] bool: query block q sees some key of key block k, from each block's first and
    last document id [b, nb] (None: causal over the whole sequence). Ids grow along a sample,
    so an earlier key block shares a document with a query block iff its last id is the query
    block's first; a block always sees itself."""
    index = torch.arange(num_blocks)
    below = index.unsqueeze(1) > index.unsqueeze(0)  # [q, k]: key block earlier
    if first is not None:
        below = below & (last.unsqueeze(1) == first.unsqueeze(2)).any(0)
    return below | torch.eye(num_blocks, dtype=torch.bool)


def _assign(weights: list[float], cp: int) -> list[list[int]]:
    """Blocks (by weight) to cp equal-sized bins of near-equal total weight: heaviest first to
    the lightest bin with room, then swaps between the heaviest and lightest bins."""
    per_rank = len(weights) // cp
    bins: list[list[int]] = [[] for _ in range(cp)]
    load = [0.0] * cp
    for b in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        r = min((r for r in range(cp) if len(bins[r]) < per_rank), key=lambda r: (load[r], r))
        bins[r].append(b)
        load[r] += weights[b]
    for _ in range(4 * len(weights)):
        hi, lo = max(range(cp), key=lambda r: load[r]), min(range(cp), key=lambda r: load[r])
        gap = load[hi] - load[lo]
        best = None  # the swap that brings the two closest to each other
        for a in bins[hi]:
            for b in bins[lo]:
                delta = weights[a] - weights[b]
                if 0 < delta < gap and (best is None or abs(gap - 2 * delta) < best[0]):
                    best = (abs(gap - 2 * delta), a, b, delta)
        if best is None or best[0] >= gap:
            break
        _, a, b, delta = best
        bins[hi][bins[hi].index(a)], bins[lo][bins[lo].index(b)] = b, a
        load[hi] -= delta
        load[lo] += delta
    return [sorted(b) for b in bins]


WINDOW_SLACK = 0.05
"""At cp 2 the placement is a window (`_window`) when that balances the work within this
fraction of the mean; otherwise blocks are placed one by one (`_assign`)."""


def _window(weights: list[float]) -> list[list[int]]:
    """cp 2: rank 1 holds the window of half the blocks [x, x + nb / 2), rank 0 the rest (its
    two ends), x chosen so that the window holds half the work. Each rank holds at most two
    runs of consecutive blocks, so a document is cut at most twice: its queries read few
    runs of keys. x = nb / 4 is the static split."""
    nb, half = len(weights), len(weights) // 2
    total, inside = sum(weights), sum(weights[:half])
    best, best_gap = 0, abs(2 * inside - total)
    for x in range(1, half + 1):  # slide the window one block
        inside += weights[x + half - 1] - weights[x - 1]
        if abs(2 * inside - total) < best_gap:
            best, best_gap = x, abs(2 * inside - total)
    return [list(range(best)) + list(range(best + half, nb)), list(range(best, best + half))]


def _static_blocks(num_blocks: int, cp: int) -> list[list[int]]:
    """The static split's blocks per rank (sequence.py: chunks r and 2cp - 1 - r)."""
    per_chunk = num_blocks // (2 * cp)
    return [
        [c * per_chunk + j for c in chunk_ids(r, cp) for j in range(per_chunk)] for r in range(cp)
    ]


def place_blocks(
    seq_length: int,
    block_size: int,
    cp: int,
    document_ids: torch.Tensor | None = None,
    balance: bool = True,
) -> BlockPlacement:
    """The placement of a micro batch whose samples have `document_ids` [b, S] (None: causal
    attention over the whole sequence); with `balance` False the static split's blocks
    (--cp-placement static_blocks: the comparison point of the balancing alone)."""
    chunks = cp if balance else 2 * cp
    if seq_length % (block_size * chunks):
        raise ValueError(
            f"--seq-length ({seq_length}) must be divisible by --cp-block-size ({block_size}) "
            f"x {'' if balance else '2 x '}--context-parallel-size ({cp}) under --cp-placement "
            + ("dynamic" if balance else "static_blocks")
        )
    per_block = token_work(seq_length, document_ids).view(-1, block_size).sum(1).tolist()
    if not balance:
        blocks = _static_blocks(len(per_block), cp)
    else:
        blocks = _window(per_block) if cp == 2 else None
        if blocks is None or imbalance(_loads(per_block, blocks)) > WINDOW_SLACK:
            blocks = _assign(per_block, cp)
    first = last = None
    if document_ids is not None:
        document_ids = document_ids.cpu()
        tiles = document_ids.view(document_ids.shape[0], -1, block_size)  # [b, nb, N]
        first, last = tiles[..., 0], tiles[..., -1]
    visible = block_visibility(len(per_block), first, last)
    work = tuple(_loads(per_block, blocks))
    return BlockPlacement(block_size, tuple(tuple(b) for b in blocks), work, visible, document_ids)


def split_batch_dynamic(
    batch: dict, cp_rank: int, cp_size: int, block_size: int, balance: bool = True
) -> dict:
    """`batch` cut to `cp_rank`'s blocks of its placement ([b, S] -> [b, S / cp]), with global
    `position_ids` added when absent and the placement under "cp_placement" (the whole
    sequence's `document_ids` stay whole)."""
    b, s = batch["tokens"].shape
    placement = place_blocks(s, block_size, cp_size, batch.get("document_ids"), balance)
    out = dict(batch)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(s, device=batch["tokens"].device).expand(b, s)
    index = placement.token_index(cp_rank, batch["tokens"].device)
    for key in SEQUENCE_KEYS:
        if key in out:
            out[key] = out[key][:, index]
    out["cp_placement"] = placement
    return out
