"""Which part of each sequence a context-parallel rank holds, and taking that part of a batch.

A sequence of length S is cut into 2 x cp equal chunks; cp rank r holds chunks r and
2cp - 1 - r, in that order (Megatron's causal load balancing: under a causal mask the early
chunks attend to little and the late ones to much, so every rank gets one of each):

    cp = 2, S = 8:   chunks [0 1 | 2 3 | 4 5 | 6 7]   rank 0: chunks 0, 3   rank 1: chunks 1, 2

    batch = split_batch(batch, cp_rank, cp_size)    # [b, S] tensors -> [b, S / cp]
    pos = local_positions(S, cp_rank, cp_size)      # global positions of the local tokens

Everything downstream (embeddings, rotary tables, the loss) sees local tokens and takes their
global positions from here.
"""

from __future__ import annotations

import torch

SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
"""The [b, s] tensors of a micro batch that are split along the sequence."""


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) that `cp_rank` holds: early one first."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(seq_length: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions [S / cp] of the tokens `cp_rank` holds, in local order."""
    if seq_length % (2 * cp_size):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 x cp ({cp_size})")
    c = seq_length // (2 * cp_size)
    return torch.cat(
        [torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(cp_rank, cp_size)]
    )


def split_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int) -> torch.Tensor:
    """`cp_rank`'s two chunks of `x` along `dim` (the sequence), concatenated."""
    if cp_size == 1:
        return x
    chunks = x.chunk(2 * cp_size, dim=dim)
    first, second = chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def split_batch(batch: dict, cp_rank: int, cp_size: int) -> dict:
    """A micro batch's [b, S] tensors cut to `cp_rank`'s part [b, S / cp]. `position_ids` is
    added (global positions) when the batch has none, so every stage can read them."""
    if cp_size == 1:
        return batch
    out = dict(batch)
    if "position_ids" not in out:
        b, s = batch["tokens"].shape
        out["position_ids"] = torch.arange(s, device=batch["tokens"].device).expand(b, s)
    for key in SEQUENCE_KEYS:
        if key in out:
            out[key] = split_sequence(out[key], cp_rank, cp_size, dim=1)
    return out
