"""Helpers shared by the data tests."""

from __future__ import annotations

import json
import os

import numpy as np

from megadyn.data.indexed_dataset import IndexedDatasetWriter

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Data parallel ranks read disjoint micro batches of the same global batch.",
    "A tokenizer turns text into integers, and back again without loss.",
    "Megatron writes an index file and a binary file for every dataset.",
    "Numbers like 1234 and 56.78 are split into digits; symbols like {} and <> stay.",
    "Unicode text: café, naïve, Zürich, 東京, emoji 🙂.",
]


def write_jsonl(path: str, records: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def make_indexed(prefix: str, doc_lengths: list[int], seed: int = 0, vocab: int = 1000) -> list:
    """An indexed dataset of random documents of the given lengths; returns the documents."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, n).astype(np.uint16) for n in doc_lengths]
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for doc in docs:
            writer.add_document(doc)
    return docs


def listdir(path) -> list[str]:
    return sorted(os.listdir(path))
