"""One sample per document (--sample-per-document): variable-length samples, no packing.

A `DocumentDataset` is the documents of a split in a seeded shuffled order; item i is one whole
document, cut at `seq_length + 1` tokens: a document longer than that keeps its first
seq_length + 1 tokens and the rest of it is not trained on (it does not become another sample).
Documents of fewer than 2 tokens hold no prediction and are left out. Item i is a dict of
torch tensors of shape [L], L = min(document length, seq_length + 1) - 1:

    tokens        int64    document[:L]
    labels        int64    document[1:L + 1]
    loss_mask     float32  all ones (padding, added when micro batches are formed, gets zeros)
    position_ids  int64    0 .. L - 1

One epoch is `len(dataset)` samples, every kept document once; later epochs are the
`GlobalSampleOrder`'s seeded permutations of the same documents (sampler.py).

    ds = DocumentDataset(indexed, np.arange(0, 900), seq_length=2048, seed=1234)
    ds.sample_length(7)   # L of item 7, from the index alone
"""

from __future__ import annotations

import numpy as np
import torch

from megadyn.data.indexed_dataset import IndexedDataset
from megadyn.data.mock_dataset import sample_from_window


class DocumentDataset(torch.utils.data.Dataset):
    """The documents `documents` (sequence ids) of `indexed`, one per sample, seeded order."""

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: np.ndarray,
        seq_length: int,
        seed: int,
    ) -> None:
        if seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
        self.indexed, self.seq_length = indexed, seq_length
        documents = np.asarray(documents, dtype=np.int64)
        kept = documents[indexed.sequence_lengths[documents] >= 2]
        order = np.random.RandomState(seed).permutation(len(kept))
        self.documents = kept[order]  # [num samples] document id of each sample
        self.lengths = np.minimum(indexed.sequence_lengths[self.documents], seq_length + 1) - 1
        self.description = dict(
            cls="DocumentDataset", path_prefix=indexed.path_prefix, seq_length=seq_length
        )

    def __len__(self) -> int:
        return len(self.documents)

    def sample_length(self, index: int) -> int:
        """Tokens (L) of sample `index`."""
        return int(self.lengths[index])

    def window(self, index: int) -> np.ndarray:
        """The L + 1 token ids of sample `index` (its document, cut), as int64."""
        length = self.sample_length(index) + 1
        return self.indexed.get(int(self.documents[index]), 0, length).astype(np.int64)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        return sample_from_window(self.window(index))
