"""The smallest and largest token id in an indexed dataset, read once and cached beside its `.bin`.

A dataset tokenized with one tokenizer and trained with a smaller vocabulary fails deep in the
first step (an embedding lookup out of range); the trainer compares this range with the
tokenizer's vocabulary before it builds anything (megadyn/training/data_setup.py).

    token_range("data/corpus_text_document")   # -> (0, 8191); None: no tokens
    # cached in data/corpus_text_document.bin.token-range.json, keyed by the .bin's size and
    # mtime: a rewritten .bin is scanned again; a read-only directory is scanned every time

The scan is one numpy max (and min, for signed token types) over the memory-mapped `.bin`.
"""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np

from megadyn.data.atomic_files import write_bytes_atomic
from megadyn.data.indexed_dataset import IndexedDataset, bin_path

SIDECAR_SUFFIX = ".token-range.json"
"""Appended to the `.bin` path: the cache of its token range."""


def sidecar_path(prefix: str) -> str:
    """Where the token range of the dataset at `prefix` is cached."""
    return bin_path(prefix) + SIDECAR_SUFFIX


def token_range(prefix: str) -> tuple[int, int] | None:
    """(smallest, largest) token id of the dataset at `prefix` (the smallest taken as 0 for
    unsigned token types); None when it holds no tokens."""
    token_file = bin_path(prefix)
    stat = os.stat(token_file)
    key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    cached = _read_cache(sidecar_path(prefix), key)
    if cached is not None:
        return cached["range"]
    dtype = IndexedDataset(prefix).dtype  # checks the pair first: a damaged one says so
    tokens = np.memmap(token_file, mode="r", dtype=dtype) if stat.st_size else np.empty(0, dtype)
    found = None
    if tokens.size:
        low = int(tokens.min()) if np.issubdtype(dtype, np.signedinteger) else 0
        found = (low, int(tokens.max()))
    with contextlib.suppress(OSError):  # a read-only directory: scan again next time
        record = json.dumps({**key, "range": found}).encode()
        write_bytes_atomic(sidecar_path(prefix), record)
    return found


def _read_cache(path: str, key: dict) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or any(record.get(k) != v for k, v in key.items()):
        return None  # the .bin changed since (or the file is not ours)
    found = record.get("range")
    return {"range": None if found is None else (int(found[0]), int(found[1]))}
