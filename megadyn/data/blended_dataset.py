"""Blend several datasets by weight, as Megatron's BlendedDataset does.

Sample i of the blend comes from the dataset whose share so far lags its weight the most
(Megatron's `build_blending_indices`): after any number n of samples, every dataset has
contributed within one sample of weight * n, and the order depends on nothing but the weights.

    blend = BlendedDataset([dataset_a, dataset_b], [0.3, 0.7], size=10_000, cache_dir="cache")
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from megadyn.data.gpt_indices import cache_key, load_or_build


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """`--data-path`: `prefix`, `w1 prefix1 w2 prefix2 ...`, or `prefix1 prefix2 ...`.

    Returns the prefixes and the normalized weights (None when no weights are given).
    """
    items = list(data_path)
    if not items:
        raise ValueError("--data-path is empty")
    if len(items) == 1:
        return items, None
    if len(items) % 2 == 0:
        try:
            weights = [float(w) for w in items[0::2]]
        except ValueError:
            weights = None
        if weights is not None:
            if any(w < 0 for w in weights) or sum(weights) <= 0:
                raise ValueError(f"--data-path weights must be >= 0 with a positive sum: {weights}")
            return items[1::2], [w / sum(weights) for w in weights]
    return items, None


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per blended sample: which dataset (int16) and which of its samples (int64)."""
    weights = [float(w) for w in weights]
    counts = [0] * len(weights)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for i in range(size):
        step = max(float(i), 1.0)
        errors = [w * step - c for w, c in zip(weights, counts)]
        best = errors.index(max(errors))  # first of equal errors, as Megatron's strict '>'
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """`size` samples drawn from `datasets` following `weights` (normalized here).

    A component asked for more samples than it holds wraps around to its start.
    """

    def __init__(
        self,
        datasets: Sequence[torch.utils.data.Dataset],
        weights: Sequence[float],
        size: int,
        cache_dir: str | None = None,
    ) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("BlendedDataset needs one weight per dataset")
        if len(datasets) > np.iinfo(np.int16).max:
            raise ValueError("BlendedDataset blends at most 32767 datasets")
        total = float(sum(weights))
        self.datasets = list(datasets)
        self.weights = [float(w) / total for w in weights]
        self.size = int(size)
        self.description = dict(
            cls="BlendedDataset",
            datasets=[cache_key(getattr(d, "description", {"len": len(d)})) for d in datasets],
            weights=self.weights,
            size=self.size,
        )
        arrays = load_or_build(
            cache_dir,
            self.description,
            ("dataset_index", "dataset_sample_index"),
            lambda: dict(
                zip(
                    ("dataset_index", "dataset_sample_index"),
                    build_blending_indices(self.weights, self.size),
                )
            ),
        )
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} of {self.size}")
        dataset = self.datasets[int(self.dataset_index[index])]
        return dataset[int(self.dataset_sample_index[index]) % len(dataset)]
