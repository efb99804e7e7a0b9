"""Which samples each data-parallel rank reads: a pure function of the global data cursor.

The cursor is `consumed_samples`, the number of samples the whole job has consumed. One micro
batch step consumes `micro_batch_size * dp_size` samples; within it, DP rank r takes global
sample indices `consumed + r * mbs ... consumed + (r + 1) * mbs - 1`. The global order of samples
therefore never depends on dp_size, and a job that changes dp at a global-batch boundary (keeping
the global batch size) neither loses nor repeats a sample:

    dp=2, mbs=2, consumed=8:  rank 0 -> 8, 9    rank 1 -> 10, 11    then consumed = 12
    dp=3, mbs=2, consumed=12: rank 0 -> 12, 13  rank 1 -> 14, 15    rank 2 -> 16, 17

A global sample index g maps to dataset index `order(g)`: epoch g // len(dataset) reads the
dataset in its own (already shuffled) order for epoch 0, and in a permutation seeded by
(seed, epoch) after that, so a run that outlasts the dataset keeps going deterministically.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


def micro_batch_indices(
    consumed_samples: int, dp_rank: int, dp_size: int, micro_batch_size: int
) -> range:
    """Global sample indices of DP rank `dp_rank`'s micro batch at cursor `consumed_samples`."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
    if micro_batch_size < 1 or consumed_samples < 0:
        raise ValueError("micro_batch_size must be >= 1 and consumed_samples >= 0")
    start = consumed_samples + dp_rank * micro_batch_size
    return range(start, start + micro_batch_size)


def samples_per_micro_step(micro_batch_size: int, dp_size: int) -> int:
    """Global samples consumed by one micro batch on every DP rank."""
    return micro_batch_size * dp_size


class DataCursor:
    """The `consumed_samples` cursor a loader keeps; setting it calls `_cursor_moved`."""

    _consumed: int = 0

    @property
    def consumed_samples(self) -> int:
        """The global data cursor: samples consumed by all DP ranks together."""
        return self._consumed

    @consumed_samples.setter
    def consumed_samples(self, value: int) -> None:
        if value < 0:
            raise ValueError("consumed_samples must be >= 0")
        self._consumed = int(value)
        self._cursor_moved()

    def _cursor_moved(self) -> None:
        """What a loader drops when its cursor is set (prefetched batches, say)."""


@lru_cache(maxsize=2)
def _epoch_permutation(length: int, seed: int, epoch: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64([seed, epoch, length]))
    return rng.permutation(length)


class GlobalSampleOrder:
    """Maps a global sample index to a dataset index; a function of (seed, index) only."""

    def __init__(self, dataset_length: int, seed: int = 0) -> None:
        if dataset_length < 1:
            raise ValueError("cannot sample from an empty dataset")
        self.length, self.seed = dataset_length, seed

    def __call__(self, global_index: int) -> int:
        epoch, position = divmod(int(global_index), self.length)
        if epoch == 0:
            return position
        return int(_epoch_permutation(self.length, self.seed, epoch)[position])
