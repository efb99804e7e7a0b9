"""The micro-batch iterator of one data-parallel rank, driven by the global data cursor.

    loader = MicroBatchLoader(train_ds, micro_batch_size=2, dp_rank=r, dp_size=4,
                              consumed_samples=state["consumed_samples"], num_workers=2)
    batch = next(loader)              # {"tokens": int64 [2, s], "labels": ..., ...}
    loader.consumed_samples           # advanced by micro_batch_size * dp_size per batch

Each micro batch is a pure function of (consumed_samples, dp_rank, dp_size, micro_batch_size,
seed) (see sampler.py), so after a change of data-parallel size at a global-batch boundary the
trainer builds new loaders at the same `consumed_samples` and the global order of samples goes on
unchanged. With `num_workers > 0`, a thread pool computes the next micro batches ahead of use;
results are still taken in cursor order, so prefetching never changes what is returned. Setting
`consumed_samples` drops whatever was prefetched. A `transform` (the document masking of
documents.py) is applied to each collated micro batch; it never changes which samples are read.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megadyn.data.sampler import DataCursor, GlobalSampleOrder, micro_batch_indices


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack sample dicts into a batch dict ([mbs, ...] per key)."""
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


class MicroBatchLoader(DataCursor):
    """An endless iterator of this DP rank's collated micro batches.

    Past the end of the dataset it goes on into the next epoch (see `GlobalSampleOrder`).
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        consumed_samples: int = 0,
        num_workers: int = 0,
        seed: int = 0,
        prefetch_factor: int = 2,
        transform: Callable[[dict], dict] | None = None,
    ) -> None:
        micro_batch_indices(consumed_samples, dp_rank, dp_size, micro_batch_size)  # validate
        self.dataset = dataset
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.order = GlobalSampleOrder(len(dataset), seed)
        self.transform = transform
        self._consumed = consumed_samples
        self._depth = max(1, num_workers * prefetch_factor)
        self._pool = ThreadPoolExecutor(num_workers, "megadyn-data") if num_workers > 0 else None
        self._ahead: collections.deque[tuple[int, Future]] = collections.deque()

    @property
    def step_samples(self) -> int:
        """Global samples consumed per micro batch (micro_batch_size * dp_size)."""
        return self.micro_batch_size * self.dp_size

    def _cursor_moved(self) -> None:
        self._drop_prefetched()

    def batch_at(self, consumed_samples: int) -> dict[str, torch.Tensor]:
        """The micro batch this rank reads at cursor `consumed_samples` (no state change)."""
        indices = micro_batch_indices(
            consumed_samples, self.dp_rank, self.dp_size, self.micro_batch_size
        )
        batch = collate([self.dataset[self.order(g)] for g in indices])
        return batch if self.transform is None else self.transform(batch)

    def __iter__(self) -> MicroBatchLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._pool is None:
            batch = self.batch_at(self._consumed)
        else:
            self._fill()
            cursor, future = self._ahead.popleft()
            assert cursor == self._consumed
            batch = future.result()
        self._consumed += self.step_samples
        return batch

    def _fill(self) -> None:
        if self._ahead and self._ahead[0][0] != self._consumed:
            self._drop_prefetched()
        next_cursor = self._ahead[-1][0] + self.step_samples if self._ahead else self._consumed
        while len(self._ahead) < self._depth:
            self._ahead.append((next_cursor, self._pool.submit(self.batch_at, next_cursor)))
            next_cursor += self.step_samples

    def _drop_prefetched(self) -> None:
        while self._ahead:
            self._ahead.pop()[1].cancel()

    def close(self) -> None:
        """Stop the prefetch threads."""
        self._drop_prefetched()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
