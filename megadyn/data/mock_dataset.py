"""Mock GPT data whose tokens are a pure function of (seed, sample index), and the sample dict.

A mock sample is a run of short synthetic "documents", each counting up by one from a random
start (mod the vocabulary), separated by EOD when an EOD id inside the vocabulary is given. This
is learnable (the loss falls well below ln(vocab)), so smoke runs show training works, and every
layout sees the same tokens for the same global sample index.

    dataset = MockGPTDataset(vocab_size=50304, seq_length=2048, seed=1234, num_samples=10**6)
    dataset[7]["tokens"]  # int64 [2048], identical in every process and run
"""

from __future__ import annotations

import numpy as np
import torch


def sample_from_window(window: np.ndarray) -> dict[str, torch.Tensor]:
    """The training sample of a window of seq_length + 1 token ids (see gpt_dataset.py)."""
    text = torch.from_numpy(np.ascontiguousarray(window, dtype=np.int64))
    seq_length = len(text) - 1
    return {
        "tokens": text[:-1],
        "labels": text[1:],
        "loss_mask": torch.ones(seq_length, dtype=torch.float32),
        "position_ids": torch.arange(seq_length, dtype=torch.int64),
    }


class MockGPTDataset(torch.utils.data.Dataset):
    """`num_samples` synthetic samples; sample i depends only on (seed, i)."""

    def __init__(
        self, vocab_size: int, seq_length: int, seed: int, num_samples: int, eod: int | None = None
    ) -> None:
        if vocab_size < 2 or seq_length < 1 or num_samples < 0 or seed < 0:
            raise ValueError("MockGPTDataset needs vocab_size >= 2, seq_length >= 1, seed >= 0")
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        self.num_samples = num_samples
        self.eod = eod if eod is not None and 0 <= eod < vocab_size else None
        self.description = dict(
            cls="MockGPTDataset",
            vocab_size=vocab_size,
            seq_length=seq_length,
            seed=seed,
            eod=self.eod,
        )

    def __len__(self) -> int:
        return self.num_samples

    def window(self, index: int) -> np.ndarray:
        """The seq_length + 1 token ids of sample `index`."""
        rng = np.random.default_rng([self.seed, index])
        size = self.seq_length + 1
        data_vocab = self.vocab_size - (self.eod is not None)
        out = np.empty(size, dtype=np.int64)
        pos = 0
        while pos < size:
            length = int(rng.integers(1, max(2, self.seq_length // 4)))
            run = (int(rng.integers(0, data_vocab)) + np.arange(length)) % data_vocab
            if self.eod is not None:
                run += run >= self.eod  # skip the eod id
                run = np.append(run, self.eod)
            take = min(len(run), size - pos)
            out[pos : pos + take] = run[:take]
            pos += take
        return out

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} of {self.num_samples}")
        return sample_from_window(self.window(index))
