"""GPT dataset indices, their cache, splits, blending and mock data."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from data_helpers import listdir, make_indexed

from megadyn.data import gpt_dataset
from megadyn.data.blended_dataset import BlendedDataset, parse_data_path
from megadyn.data.gpt_dataset import GPTDataset, build_gpt_datasets, parse_split, split_ranges
from megadyn.data.gpt_indices import build_document_index, build_sample_index
from megadyn.data.indexed_dataset import IndexedDataset
from megadyn.data.mock_dataset import MockGPTDataset

LENGTHS = [5, 1, 40, 0, 13, 7, 64, 2, 9, 30, 3, 17]


def megatron_sample_index(lengths, document_index, seq_length, num_samples):
    """Megatron's C++ `build_sample_idx` loop, transcribed, as the reference."""
    out, doc_pos, offset = [(0, 0)], 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = lengths[document_index[doc_pos]] - offset
            remaining -= doc_length
            if remaining <= 0:
                offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_pos, offset = doc_pos + 1, 0
        out.append((doc_pos, offset))
    return np.array(out)


def test_sample_index_matches_megatron_helper():
    lengths = np.array(LENGTHS, dtype=np.int32)
    rng = np.random.RandomState(3)
    for seq_length in (1, 4, 16, 50):
        doc_index = build_document_index(np.arange(len(lengths)), 3, rng, False)
        ours = build_sample_index(lengths, doc_index, seq_length)
        reference = megatron_sample_index(lengths, doc_index, seq_length, len(ours) - 1)
        assert np.array_equal(ours, reference)
        assert len(ours) - 1 == (3 * lengths.sum() - 1) // seq_length


def test_windows_are_consecutive_slices_of_the_shuffled_epochs(tmp_path):
    docs = make_indexed(str(tmp_path / "d"), LENGTHS)
    indexed = IndexedDataset(str(tmp_path / "d"))
    documents = np.arange(2, 11)  # a document range, as a split uses
    dataset = GPTDataset(indexed, documents, seq_length=8, seed=5, num_samples=40)
    assert len(dataset) >= 40
    per_epoch = sorted(documents.tolist()) * (len(dataset.document_index) // len(documents))
    assert sorted(dataset.document_index.tolist()) == sorted(per_epoch)
    stream = np.concatenate([docs[d] for d in dataset.document_index]).astype(np.int64)
    seen = set()
    for i in range(len(dataset)):
        sample = dataset[i]
        j = int(dataset.shuffle_index[i])
        seen.add(j)
        window = stream[j * 8 : j * 8 + 9]
        assert torch.equal(sample["tokens"], torch.from_numpy(window[:-1]))
        assert torch.equal(sample["labels"], torch.from_numpy(window[1:]))
        assert sample["loss_mask"].dtype == torch.float32 and bool((sample["loss_mask"] == 1).all())
        assert torch.equal(sample["position_ids"], torch.arange(8))
    assert seen == set(range(len(dataset)))


def test_index_cache_is_reused_and_keyed_by_inputs(tmp_path, monkeypatch):
    make_indexed(str(tmp_path / "d"), LENGTHS)
    indexed = IndexedDataset(str(tmp_path / "d"))
    cache = tmp_path / "cache"
    first = GPTDataset(indexed, np.arange(12), 8, seed=1, num_samples=20, cache_dir=str(cache))
    files = listdir(cache)
    assert len(files) == 4 and not any(".tmp-" in f for f in files)

    def no_build(*args, **kwargs):
        raise AssertionError("indices rebuilt despite a cache hit")

    monkeypatch.setattr(gpt_dataset, "build_gpt_indices", no_build)
    again = GPTDataset(indexed, np.arange(12), 8, seed=1, num_samples=20, cache_dir=str(cache))
    assert np.array_equal(again.shuffle_index, first.shuffle_index)
    assert torch.equal(again[3]["tokens"], first[3]["tokens"])
    monkeypatch.undo()
    for change in (dict(seed=2), dict(num_samples=21), dict(seq_length=9)):
        args = dict(seq_length=8, seed=1, num_samples=20) | change
        GPTDataset(indexed, np.arange(12), cache_dir=str(cache), **args)
    assert len(listdir(cache)) == 4 * 4


def test_split_parsing_and_ranges():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("90/10") == pytest.approx([0.9, 0.1, 0.0])
    assert split_ranges(parse_split("969,30,1"), 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(parse_split("1,1,1"), 10) == [(0, 4), (4, 7), (7, 10)]  # as Megatron
    with pytest.raises(ValueError, match="--split"):
        parse_split("0,0,0")


def test_build_gpt_datasets_splits_by_document_ranges(tmp_path):
    make_indexed(str(tmp_path / "d"), [20] * 100)
    train, valid, test = build_gpt_datasets(
        [str(tmp_path / "d")], "80,20,0", 16, 7, (50, 10, 5), str(tmp_path / "c"), tokenizer_eod=0
    )
    assert test is None and len(train) >= 50 and len(valid) >= 10
    assert set(train.document_index.tolist()) == set(range(80))
    assert set(valid.document_index.tolist()) == set(range(80, 100))
    assert build_gpt_datasets([str(tmp_path / "d")], "1,0,0", 16, 7, (5, 0, 0), None, 0)[1] is None


def test_blending_follows_weights_within_one_percent(tmp_path):
    # dataset A holds tokens < 500, dataset B tokens >= 500: each sample shows its source
    make_indexed(str(tmp_path / "a"), [50] * 200, seed=1, vocab=500)
    prefix_b = str(tmp_path / "b")
    make_indexed(prefix_b, [50] * 200, seed=2, vocab=500)
    from megadyn.data.indexed_dataset import IndexedDatasetWriter

    shifted = [IndexedDataset(prefix_b)[i] + 500 for i in range(200)]
    with IndexedDatasetWriter(prefix_b, np.uint16) as writer:
        for doc in shifted:
            writer.add_document(doc)
    data_path = ["0.3", str(tmp_path / "a"), "0.7", prefix_b]
    assert parse_data_path(data_path) == ([str(tmp_path / "a"), prefix_b], [0.3, 0.7])
    train, _, _ = build_gpt_datasets(
        data_path, "1,0,0", 32, 3, (10_000, 0, 0), str(tmp_path / "c"), 0
    )
    assert isinstance(train, BlendedDataset) and len(train) == 10_000
    from_a = sum(int(train[i]["tokens"][0] < 500) for i in range(10_000))
    assert abs(from_a / 10_000 - 0.3) < 0.01
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert abs(counts[0] - 3000) <= 1 and abs(counts[1] - 7000) <= 1


def test_mock_samples_are_a_pure_function_of_seed_and_index():
    a = MockGPTDataset(vocab_size=1000, seq_length=64, seed=11, num_samples=100, eod=3)
    b = MockGPTDataset(vocab_size=1000, seq_length=64, seed=11, num_samples=100, eod=3)
    c = MockGPTDataset(vocab_size=1000, seq_length=64, seed=12, num_samples=100, eod=3)
    assert torch.equal(a[42]["tokens"], b[42]["tokens"])
    assert not torch.equal(a[42]["tokens"], a[43]["tokens"])
    assert not torch.equal(a[42]["tokens"], c[42]["tokens"])
    sample = a[5]
    assert sample["tokens"].shape == (64,) and int(sample["tokens"].max()) < 1000
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    assert bool((sample["tokens"] == 3).any())
    train, valid, test = build_gpt_datasets(
        None, "969,30,1", 64, 11, (10, 2, 0), None, 3, mock=True, vocab_size=1000
    )
    assert test is None and len(train) == 10 and torch.equal(train[4]["tokens"], a[4]["tokens"])


def test_dataset_without_documents_is_an_error_naming_its_prefix(tmp_path):
    empty, full = str(tmp_path / "empty"), str(tmp_path / "full")
    make_indexed(empty, [])
    make_indexed(full, [20] * 10)
    for data_path in ([empty], [full, empty], ["0.5", full, "0.5", empty]):
        with pytest.raises(ValueError, match=re.escape(empty) + r".*no documents"):
            build_gpt_datasets(data_path, "949,50,1", 16, 7, (5, 1, 1), None, 0)
    hollow = str(tmp_path / "hollow")
    make_indexed(hollow, [0] * 4)
    with pytest.raises(ValueError, match=re.escape(hollow) + r".*4 documents .* hold 0 tokens"):
        build_gpt_datasets([hollow], "949,50,1", 16, 7, (5, 1, 1), None, 0)
