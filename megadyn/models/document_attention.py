"""Causal attention within documents (--reset-attention-mask), without context parallelism.

A micro batch's `document_ids` [b, s] (megadyn/data/documents.py; non-decreasing along each
sample) let a query see a key when the key is not later and both have the same id:

    mask = DocumentMask.build(document_ids)      # once per micro batch and model chunk
    out = document_attention(q, k, v, mask)      # q [b, n, s, d], k and v [b, g, s, d]

On a GPU the attention is torch's flex_attention (compiled) under a block mask built from the
ids: a 128 x 128 tile of scores is skipped when no key of it is visible, computed without a
mask when every key is, and masked element by element otherwise, so no [s, s] tensor exists.
Elsewhere (the CPU) it is scaled_dot_product_attention under a dense boolean mask [b, 1, s, s].
Under context parallelism the ring and all-gather attention take the ids themselves
(megadyn/core/context_parallel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from megadyn.core.context_parallel.documents import PackedDocuments, packed
from megadyn.core.context_parallel.flex import TILE, flex, tile_mask

BLOCK = TILE
"""Tile size of the flex_attention block mask (flex_attention's default)."""


def dense_document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool: query i sees key j when j <= i and both are in the same document."""
    s = document_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)  # [b, s, s]
    return (same & causal).unsqueeze(1)


def document_block_mask(document_ids: torch.Tensor, block: int = BLOCK) -> BlockMask:
    """flex_attention's BlockMask of `dense_document_mask` (flex.py's tile mask over the
    positions 0 .. s - 1): memory O(b (s / block)^2)."""
    positions = torch.arange(document_ids.shape[1], device=document_ids.device)
    return tile_mask(document_ids, positions, positions, block)


@dataclass(frozen=True)
class DocumentMask:
    """One micro batch's documents in the form its attention kernel takes."""

    document_ids: torch.Tensor | None
    """[b, s] document index of each token (the whole sequence under context parallelism);
    None under --cp-placement dynamic without --reset-attention-mask (causal only)."""
    block_mask: BlockMask | None = None
    """flex_attention's block mask (CUDA)."""
    dense: torch.Tensor | None = None
    """[b, 1, s, s] bool mask for scaled_dot_product_attention (elsewhere)."""
    cp_placement: object | None = None
    """Under --cp-placement dynamic: the micro batch's `BlockPlacement`
    (megadyn/core/context_parallel/placement.py), which the attention's blocks follow."""
    packed: PackedDocuments | None = None
    """Under context parallelism: `document_ids` as its attention takes them, with their host
    copy (made at its first use, once per micro batch), from which the blocks' per-document kernel calls take
    their ranges (every layer's, computed once: PackedDocuments.derived)."""

    @classmethod
    def build(
        cls, document_ids: torch.Tensor | None, context_parallel: bool = False, cp_placement=None
    ) -> DocumentMask:
        """The mask of `document_ids`; under context parallelism the ids alone (the ring and
        all-gather attention mask the blocks they compute), with the dynamic placement if any."""
        if context_parallel:
            return cls(document_ids, cp_placement=cp_placement, packed=packed(document_ids))
        if document_ids.is_cuda:
            return cls(document_ids, block_mask=document_block_mask(document_ids))
        return cls(document_ids, dense=dense_document_mask(document_ids))


def document_attention(q, k, v, mask: DocumentMask) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v within documents; q [b, n, s, d], k and v [b, g, s, d]."""
    if mask.block_mask is not None:
        return flex(q, k, v, mask.block_mask)
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, enable_gqa=gqa)
