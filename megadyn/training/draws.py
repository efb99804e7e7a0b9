"""What a trainer's data-parallel replica drew: one small record per step, expanded into global
sample indices only when asked (the exactly-once checks, a recovery's rollback).

    trainer.draws.append(Draw(cursor, dp_rank, dp_size, n))       # Trainer.train_step
    samples = drawn_samples(trainer.draws, mbs, token_budget)     # Trainer.samples_drawn

Ranks at tp 0, cp 0 of the first stage record their replica's draws. A record starts at the data
cursor of its step and reads, by the kind of step:
- a grid layout: (cursor, dp rank, dp size, micro batches);
- token budgets (--micro-batch-tokens): (cursor, dp rank, dp size, global batch size);
- a replica of a heterogeneous layout: (cursor, first sample, 0, samples), one block.
"""

from __future__ import annotations

from typing import NamedTuple

from megadyn.data.sampler import micro_batch_indices
from megadyn.data.token_budget import step_share


class Draw(NamedTuple):
    """One step's draw of a data-parallel replica (module docstring)."""

    cursor: int
    """The data cursor (global consumed samples) at the step's start."""
    rank: int
    """The dp rank; a heterogeneous replica's first sample."""
    size: int
    """The dp size; 0 for a heterogeneous replica's block."""
    count: int
    """Micro batches; the global batch under token budgets; a block's samples."""


def block_draw(cursor: int, block: range) -> Draw:
    """The draw of a heterogeneous layout's replica that read `block` at `cursor`."""
    return Draw(cursor, block.start, 0, len(block))


def drawn_samples(draws: list[Draw], micro_batch_size: int, token_budget: bool) -> list[int]:
    """The global sample indices of `draws`, in order."""
    if token_budget:
        return [i for c, r, dp, gbs in draws for i in step_share(c, r, dp, gbs)]
    mbs = micro_batch_size
    return [
        i
        for consumed, dp_rank, dp_size, n in draws
        for i in (
            range(dp_rank, dp_rank + n)  # a replica's block of a heterogeneous layout
            if dp_size == 0
            else (
                i
                for j in range(n)
                for i in micro_batch_indices(consumed + j * mbs * dp_size, dp_rank, dp_size, mbs)
            )
        )
    ]


def draws_before(draws: list[Draw], cursor: int) -> list[Draw]:
    """The draws of steps that started before `cursor` (a recovery went back to it)."""
    return [d for d in draws if d[0] < cursor]
