"""The data cursor: samples are consumed once, in one global order, whatever dp does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from data_helpers import make_indexed

from megadyn.data.gpt_dataset import GPTDataset
from megadyn.data.indexed_dataset import IndexedDataset
from megadyn.data.loader import MicroBatchLoader
from megadyn.data.mock_dataset import MockGPTDataset
from megadyn.data.sampler import GlobalSampleOrder, micro_batch_indices

MBS, GLOBAL_BATCH = 2, 24  # 24 is a multiple of mbs * dp for dp in 1, 2, 3, 4


@pytest.fixture
def dataset(tmp_path):
    make_indexed(str(tmp_path / "d"), [37, 5, 80, 21, 64, 9, 120, 33] * 6)
    indexed = IndexedDataset(str(tmp_path / "d"))
    return GPTDataset(indexed, np.arange(len(indexed)), seq_length=16, seed=9, num_samples=192)


def test_micro_batch_indices():
    assert list(micro_batch_indices(8, 1, 2, 2)) == [10, 11]
    assert list(micro_batch_indices(12, 2, 3, 2)) == [16, 17]
    with pytest.raises(ValueError, match="dp_rank 3"):
        micro_batch_indices(0, 3, 3, 2)


def run_schedule(dataset, dp_sizes, num_workers=0):
    """Train-loop stand-in: one global batch per dp size, loaders rebuilt at each boundary.

    Returns the samples in global order (rank-major within each micro step) and the cursor.
    """
    consumed, rows, indices = 0, [], []
    for dp in dp_sizes:
        loaders = [
            MicroBatchLoader(
                dataset, MBS, r, dp, consumed_samples=consumed, num_workers=num_workers
            )
            for r in range(dp)
        ]
        for _ in range(GLOBAL_BATCH // (MBS * dp)):
            for rank, loader in enumerate(loaders):
                indices += micro_batch_indices(loader.consumed_samples, rank, dp, MBS)
                rows += list(next(loader)["tokens"])
        assert len({loader.consumed_samples for loader in loaders}) == 1
        consumed = loaders[0].consumed_samples
        for loader in loaders:
            loader.close()
    return torch.stack(rows), indices, consumed


def test_changing_dp_consumes_each_sample_once_in_the_fixed_dp_order(dataset):
    assert len(dataset) >= 192  # eight global batches, within one epoch
    schedule = [1, 4, 2, 3, 3, 2, 4, 1]
    fixed, fixed_indices, end = run_schedule(dataset, [2] * 8)
    changing, indices, end_changing = run_schedule(dataset, schedule)
    prefetched, _, _ = run_schedule(dataset, schedule, num_workers=2)
    assert end == end_changing == 192
    assert indices == fixed_indices == list(range(192))  # each sample exactly once, in order
    assert torch.equal(changing, fixed) and torch.equal(prefetched, fixed)
    assert torch.equal(fixed, torch.stack([dataset[i]["tokens"] for i in range(192)]))


def test_setting_the_cursor_drops_prefetched_batches(dataset):
    loader = MicroBatchLoader(dataset, MBS, dp_rank=1, dp_size=2, num_workers=2)
    first = [next(loader)["tokens"] for _ in range(5)]
    assert loader.consumed_samples == 5 * MBS * 2
    loader.consumed_samples = 2 * MBS * 2
    assert torch.equal(next(loader)["tokens"], first[2])
    batch = next(loader)
    assert batch["tokens"].shape == (MBS, 16) and batch["loss_mask"].dtype == torch.float32
    loader.close()


def test_wrap_around_goes_to_a_deterministic_next_epoch():
    dataset = MockGPTDataset(vocab_size=100, seq_length=4, seed=0, num_samples=10)
    order = GlobalSampleOrder(len(dataset), seed=3)
    assert [order(g) for g in range(10)] == list(range(10))
    second = [order(g) for g in range(10, 20)]
    assert sorted(second) == list(range(10)) and second != list(range(10))
    assert second == [GlobalSampleOrder(10, seed=3)(g) for g in range(10, 20)]
    loader = MicroBatchLoader(dataset, 2, 0, 1, consumed_samples=10, seed=3)
    assert torch.equal(next(loader)["tokens"][0], dataset[second[0]]["tokens"])
