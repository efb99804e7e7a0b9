"""Packed samples of documents with a skewed length distribution, for the benchmarks of
document-masked attention (megadyn/bench/dcp_compare.py, gpt.py's --documents).

    ids = skewed_document_ids(32768, generator, median=1024, sigma=1.6)   # [S] int64

Document lengths are drawn from a log-normal distribution (median `median`, shape `sigma`: most
documents short, a few as long as the sample), at least `min_length` tokens, the last one cut at
the sample's end; the ids number the documents 0, 1, ... along the sample, as
megadyn/data/documents.py's `document_ids` does.
"""

from __future__ import annotations

import math

import torch


def skewed_document_ids(
    seq: int, generator: torch.Generator, median: float = 1024.0, sigma: float = 1.6, min_length=16
) -> torch.Tensor:
    """[seq] document ids of one packed sample (see the module docstring)."""
    ids = torch.empty(seq, dtype=torch.long)
    start, doc = 0, 0
    while start < seq:
        z = torch.randn((), generator=generator).item()
        length = max(min_length, int(median * math.exp(sigma * z)))
        ids[start : start + length] = doc
        start, doc = start + length, doc + 1
    return ids


def document_lengths(ids: torch.Tensor) -> list[int]:
    """Lengths of the documents of a sample's ids [S], in order."""
    return torch.unique_consecutive(ids, return_counts=True)[1].tolist()
