"""Megatron-style GPT datasets and `build_gpt_datasets`, the one entry point the trainer calls.

A `GPTDataset` cuts a document range of an indexed dataset into windows of seq_length + 1
tokens that run across documents, over as many seeded-shuffled epochs as the requested sample
count needs (see gpt_indices.py). Item i is a dict of torch tensors, each of shape [seq_length]:

    tokens        int64    window[:-1]
    labels        int64    window[1:]
    loss_mask     float32  all ones: windows never need padding (they always hold seq_length + 1
                           real tokens), and, as Megatron without --eod-mask-loss, the EOD
                           token is a target the model learns like any other
    position_ids  int64    0 .. seq_length - 1 (positions are not reset at EOD)

(--reset-position-ids, --reset-attention-mask and --eod-mask-loss act on collated micro batches
in the loader: documents.py.)

    train, valid, test = build_gpt_datasets(["0.3", "data/a", "0.7", "data/b"], "969,30,1",
                                            seq_length=2048, seed=1234,
                                            num_samples=(16000, 160, 16), cache_dir=None,
                                            tokenizer_eod=2)
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Sequence

import numpy as np
import torch

from megadyn.data.blended_dataset import BlendedDataset, parse_data_path
from megadyn.data.document_dataset import DocumentDataset
from megadyn.data.gpt_indices import INDEX_NAMES, build_gpt_indices, load_or_build
from megadyn.data.indexed_dataset import IndexedDataset, IndexedDatasetError, bin_path, idx_path
from megadyn.data.mock_dataset import MockGPTDataset, sample_from_window

BLEND_SURPLUS = 0.005  # Megatron builds 0.5% more samples per blended component


class GPTDataset(torch.utils.data.Dataset):
    """Windows of `seq_length + 1` tokens over the given documents (sequence ids) of `indexed`.

    Its length is the number of windows built, at least `num_samples` (one epoch if None).
    `cache_dir=None` keeps the indices in memory only. `eod` is kept for the trainer; samples
    do not depend on it.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: np.ndarray,
        seq_length: int,
        seed: int,
        num_samples: int | None,
        cache_dir: str | None = None,
        eod: int | None = None,
    ) -> None:
        self.indexed, self.seq_length, self.eod = indexed, seq_length, eod
        documents = np.asarray(documents, dtype=np.int64)
        self.description = dict(
            cls="GPTDataset",
            path_prefix=os.path.abspath(indexed.path_prefix),
            file_bytes=[
                os.path.getsize(idx_path(indexed.path_prefix)),
                os.path.getsize(bin_path(indexed.path_prefix)),
            ],
            num_documents=len(documents),
            documents_md5=hashlib.md5(documents.tobytes()).hexdigest(),
            seq_length=seq_length,
            seed=seed,
            num_samples=num_samples,
            format=1,
        )
        arrays = load_or_build(
            cache_dir,
            self.description,
            INDEX_NAMES,
            lambda: build_gpt_indices(
                indexed.sequence_lengths, documents, seq_length, num_samples, seed
            ),
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def window(self, index: int) -> np.ndarray:
        """The seq_length + 1 token ids of sample `index` (after shuffling), as int64."""
        sample = int(self.shuffle_index[index])
        doc_beg, off_beg = (int(x) for x in self.sample_index[sample])
        doc_end, off_end = (int(x) for x in self.sample_index[sample + 1])
        get, docs = self.indexed.get, self.document_index
        if doc_beg == doc_end:
            return get(int(docs[doc_beg]), off_beg, off_end - off_beg + 1).astype(np.int64)
        parts = [get(int(docs[doc_beg]), off_beg)]
        parts += [get(int(docs[d])) for d in range(doc_beg + 1, doc_end)]
        parts.append(get(int(docs[doc_end]), 0, off_end + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        return sample_from_window(self.window(index))


def parse_split(split: str) -> list[float]:
    """`--split 969,30,1` (or `969/30/1`) as normalized train/valid/test weights."""
    weights = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if not 1 <= len(weights) <= 3 or sum(weights) <= 0:
        raise ValueError(
            f"--split {split!r}: expected up to three non-negative weights, e.g. 969,30,1"
        )
    weights += [0.0] * (3 - len(weights))
    return [w / sum(weights) for w in weights]


def split_ranges(weights: Sequence[float], num_documents: int) -> list[tuple[int, int]]:
    """Megatron's contiguous [begin, end) document range of each split."""
    bounds = [0]
    for weight in weights:
        bounds.append(bounds[-1] + int(round(weight * num_documents)))
    excess = bounds[-1] - num_documents
    bounds[1:] = [max(0, b - excess) for b in bounds[1:]]
    return list(zip(bounds[:-1], bounds[1:]))


def _default_cache_dir(prefix: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", "GPTDataset_indices")


def open_training_data(prefix: str) -> IndexedDataset:
    """The indexed dataset at `prefix`; one without documents is an error naming it (before
    the split ranges of an empty dataset could only say that no split has data)."""
    indexed = IndexedDataset(prefix)
    if len(indexed) == 0:
        raise IndexedDatasetError(
            f"--data-path {prefix}: no documents in {idx_path(prefix)}; preprocess a corpus "
            "that has some (tools/preprocess_data.py refuses an empty one)"
        )
    tokens = int(indexed.sequence_lengths.sum(dtype=np.int64))
    if tokens < 2:
        raise IndexedDatasetError(
            f"--data-path {prefix}: the {len(indexed)} documents of {idx_path(prefix)} hold "
            f"{tokens} tokens; a sample needs at least 2"
        )
    return indexed


def _split_datasets(
    indexed: IndexedDataset,
    split_weights: list[float],
    seq_length: int,
    seed: int,
    sizes: Sequence[int],
    cache_dir: str | None,
    eod: int,
) -> list[GPTDataset | None]:
    cache = cache_dir if cache_dir is not None else _default_cache_dir(indexed.path_prefix)
    out: list[GPTDataset | None] = []
    for (begin, end), size in zip(split_ranges(split_weights, len(indexed)), sizes):
        empty = end <= begin or size <= 0
        docs = np.arange(begin, end, dtype=np.int64)
        out.append(None if empty else GPTDataset(indexed, docs, seq_length, seed, size, cache, eod))
    return out


def build_gpt_datasets(
    data_path: list[str] | None,
    split: str,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    cache_dir: str | None,
    tokenizer_eod: int,
    mock: bool = False,
    vocab_size: int | None = None,
    sample_per_document: bool = False,
) -> tuple[torch.utils.data.Dataset | None, ...]:
    """(train, valid, test) datasets; a split with no documents or no samples asked is None.

    `data_path` is Megatron's `--data-path`: one prefix, `w1 p1 w2 p2 ...` (blended with those
    weights), or several prefixes (blended in proportion to their tokens). With `mock` (or no
    data path) the datasets are `MockGPTDataset`s over `vocab_size` with seeds seed, seed + 1,
    seed + 2. `cache_dir=None` caches indices next to the data, as Megatron does.
    `sample_per_document`: each split is a `DocumentDataset` (one document per sample, one
    epoch long; --sample-per-document), from a single prefix.
    """
    if mock or not data_path:
        if vocab_size is None:
            raise ValueError("mock data needs vocab_size")
        return tuple(
            MockGPTDataset(vocab_size, seq_length, seed + i, n, eod=tokenizer_eod)
            if n > 0
            else None
            for i, n in enumerate(num_samples)
        )
    prefixes, weights = parse_data_path(data_path)
    split_weights = parse_split(split)
    indexed = [open_training_data(p) for p in prefixes]
    if sample_per_document:
        if len(prefixes) > 1:
            raise ValueError("--sample-per-document reads one --data-path prefix, not a blend")
        ranges = split_ranges(split_weights, len(indexed[0]))
        return tuple(
            DocumentDataset(indexed[0], np.arange(b, e), seq_length, seed)
            if e > b and n > 0
            else None
            for (b, e), n in zip(ranges, num_samples)
        )
    if len(prefixes) == 1:
        return tuple(
            _split_datasets(
                indexed[0], split_weights, seq_length, seed, num_samples, cache_dir, tokenizer_eod
            )
        )
    if weights is None:  # blend in proportion to each prefix's tokens
        weights = [float(d.sequence_lengths.sum(dtype=np.int64)) for d in indexed]
    weights = [w / sum(weights) for w in weights]
    per_prefix = [
        _split_datasets(
            data,
            split_weights,
            seq_length,
            seed,
            [math.ceil(math.ceil(n * w) * (1 + BLEND_SURPLUS)) for n in num_samples],
            cache_dir,
            tokenizer_eod,
        )
        for data, w in zip(indexed, weights)
    ]
    out = []
    for i, n in enumerate(num_samples):
        parts = [(d[i], w) for d, w in zip(per_prefix, weights) if d[i] is not None]
        if n <= 0 or not parts:
            out.append(None)
            continue
        datasets, part_weights = zip(*parts)
        cache = cache_dir if cache_dir is not None else _default_cache_dir(prefixes[0])
        out.append(BlendedDataset(list(datasets), list(part_weights), n, cache))
    return tuple(out)
