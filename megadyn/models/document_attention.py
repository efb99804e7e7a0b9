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

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from megadyn.core.context_parallel.documents import PackedDocuments, packed

BLOCK = 128
"""Tile size of the flex_attention block mask (flex_attention's default)."""


def dense_document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool: query i sees key j when j <= i and both are in the same document."""
    s = document_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)  # [b, s, s]
    return (same & causal).unsqueeze(1)


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query tile: how many key tiles are set in `blocks` [b, nq, nk], and their indices
    first (ascending), as BlockMask wants them ([b, 1, nq] and [b, 1, nq, nk], int32)."""
    count = blocks.sum(-1, dtype=torch.int32)
    order = blocks.to(torch.int8).argsort(dim=-1, descending=True, stable=True)
    return count.unsqueeze(1), order.to(torch.int32).unsqueeze(1)


def document_block_mask(document_ids: torch.Tensor, block: int = BLOCK) -> BlockMask:
    """flex_attention's BlockMask of `dense_document_mask`, from per-tile document ranges:
    ids grow along a sample, so a key tile before a query tile shares a document with it iff
    its last id is the query tile's first, and lies wholly in the query tile's one document iff
    its first id is the query tile's last. Memory O(b (s / block)^2)."""
    b, s = document_ids.shape
    n = -(-s // block)
    pad = n * block - s
    ids = torch.cat([document_ids, document_ids[:, -1:].expand(b, pad)], dim=1)  # [b, n*block]
    tiles = ids.view(b, n, block)
    first, last = tiles[..., 0], tiles[..., -1]  # [b, n]
    index = torch.arange(n, device=ids.device)
    below = (index.unsqueeze(1) > index.unsqueeze(0)).unsqueeze(0)  # key tile before query's
    diagonal = torch.eye(n, dtype=torch.bool, device=ids.device).unsqueeze(0)
    shares = last.unsqueeze(1) >= first.unsqueeze(2)  # [b, nq, nk]
    full = below & (first.unsqueeze(1) == last.unsqueeze(2))
    if pad:  # the padded tail of the last key tile must be masked element by element
        full[..., -1] = False
    partial = (diagonal | (below & shares)) & ~full

    def visible(batch, head, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (ids[batch, q_idx] == ids[batch, kv_idx])

    return BlockMask.from_kv_blocks(
        *_ordered(partial), *_ordered(full), BLOCK_SIZE=block, mask_mod=visible, seq_lengths=(s, s)
    )


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


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention, dynamic=False)


def document_attention(q, k, v, mask: DocumentMask) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v within documents; q [b, n, s, d], k and v [b, g, s, d]."""
    gqa = k.shape[1] != q.shape[1]
    if mask.block_mask is not None:
        return _compiled_flex_attention()(q, k, v, block_mask=mask.block_mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, enable_gqa=gqa)
