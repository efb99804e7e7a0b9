"""The three indices of a Megatron GPT dataset, and their on-disk cache.

- document index: the dataset's documents repeated for every epoch, shuffled with the seed
  (Megatron keeps a short final epoch apart so it is not mixed into the earlier ones);
- sample index [num_samples + 1, 2]: (position in the document index, token offset) where each
  sample starts; sample i spans from entry i to entry i + 1 inclusive, seq_length + 1 tokens that
  run across document boundaries (the last token of one sample is the first of the next);
- shuffle index: a seeded permutation of the samples.

They are saved as `.npy` under `{md5 of their inputs}-{name}.npy` (written atomically), so any
change of data file, document range, sequence length, seed or sample count builds new ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable

import numpy as np

from megadyn.data.atomic_files import save_npy_atomic, write_bytes_atomic

logger = logging.getLogger(__name__)
INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
FINAL_EPOCH_THRESHOLD = 0.80  # Megatron's: a final epoch below 80% is shuffled on its own


def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Epochs needed to cut `num_samples` windows of seq_length + 1 tokens."""
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def separate_final_epoch(
    tokens_per_epoch: int, seq_length: int, num_samples: int, num_epochs: int
) -> bool:
    """Whether the last epoch contributes so few samples that it is shuffled separately."""
    if num_epochs == 1:
        return False
    before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return num_samples - before_final < int(FINAL_EPOCH_THRESHOLD * per_epoch)


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final: bool
) -> np.ndarray:
    """`documents` repeated `num_epochs` times and shuffled (the final epoch apart if asked)."""
    if separate_final and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        return np.concatenate([first, build_document_index(documents, 1, rng, False)])
    index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int
) -> np.ndarray:
    """Start (document-index position, offset) of every seq_length-token step, [n + 1, 2].

    Sample i covers global token positions [i * seq_length, (i + 1) * seq_length] of the
    concatenated documents; an entry falling on a document boundary points at the first token of
    the next non-empty document, as Megatron's C++ helper does.
    """
    doc_lengths = sequence_lengths[document_index].astype(np.int64)
    starts = np.zeros(len(doc_lengths) + 1, dtype=np.int64)
    np.cumsum(doc_lengths, out=starts[1:])
    num_samples = (int(starts[-1]) - 1) // seq_length
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc_pos = np.searchsorted(starts, positions, side="right") - 1
    dtype = (
        np.int32
        if len(doc_lengths) < 2**31 and sequence_lengths.max(initial=0) < 2**31
        else np.int64
    )
    sample_index = np.empty((num_samples + 1, 2), dtype=dtype)
    sample_index[:, 0] = doc_pos
    sample_index[:, 1] = positions - starts[doc_pos]
    return sample_index


def build_shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, num_samples) followed by one of [num_samples, total)."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_gpt_indices(
    sequence_lengths: np.ndarray,
    documents: np.ndarray,
    seq_length: int,
    num_samples: int | None,
    seed: int,
) -> dict[str, np.ndarray]:
    """Document, sample and shuffle indices for `num_samples` (None: one epoch) samples."""
    tokens_per_epoch = int(sequence_lengths[documents].sum(dtype=np.int64))
    if tokens_per_epoch < 2:
        raise ValueError(f"{len(documents)} documents hold {tokens_per_epoch} tokens: too few")
    if num_samples is None:
        num_samples = max(1, (tokens_per_epoch - 1) // seq_length)
    num_epochs = num_epochs_for(tokens_per_epoch, seq_length, num_samples)
    separate = separate_final_epoch(tokens_per_epoch, seq_length, num_samples, num_epochs)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate)
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length)
    total = len(sample_index) - 1
    shuffled = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate else total
    shuffle_index = build_shuffle_index(shuffled, total, rng)
    return dict(
        document_index=document_index, sample_index=sample_index, shuffle_index=shuffle_index
    )


def cache_key(description: dict) -> str:
    """The md5 of a JSON description of everything the indices depend on."""
    text = json.dumps(description, sort_keys=True)
    return hashlib.md5(text.encode("utf-8")).hexdigest()


def load_or_build(
    cache_dir: str | None,
    description: dict,
    names: tuple[str, ...],
    build: Callable[[], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """Load the named arrays cached for `description`, or build and cache them.

    With no cache_dir, or one that cannot be written, the arrays are built in memory.
    """
    if cache_dir is None:
        return build()
    key = cache_key(description)
    paths = {name: os.path.join(cache_dir, f"{key}-{name}.npy") for name in names}
    if all(os.path.isfile(p) for p in paths.values()):
        try:
            return {name: np.load(p, mmap_mode="r") for name, p in paths.items()}
        except (OSError, ValueError) as e:
            logger.warning("rebuilding unreadable cached indices in %s: %s", cache_dir, e)
    arrays = build()
    try:
        os.makedirs(cache_dir, exist_ok=True)
        text = json.dumps(description, sort_keys=True, indent=2)
        write_bytes_atomic(os.path.join(cache_dir, f"{key}-description.json"), text.encode())
        for name, path in paths.items():
            save_npy_atomic(path, arrays[name])
    except OSError as e:
        logger.warning("cannot cache indices in %s (%s); keeping them in memory", cache_dir, e)
    return arrays
