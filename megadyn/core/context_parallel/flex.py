"""Dynamic cp's attention on the GPU as one flex_attention call (--cp-placement dynamic or
static_blocks, --attention-backend auto, blocks a multiple of 128 tokens).

    out = flex_placement_attention(q, k, v, cp_group, placement, scale)   # q [b, n, s, d]

The keys and values of the whole sequence are gathered over the cp group (rank after rank,
each rank's tokens in its local order: the placement's token_index), and the rank's queries
attend to them under a block mask of 128 x 128 tiles made from the tokens' positions and
document ids: a tile is skipped when none of its keys is visible, computed without a mask
when all are, and masked element by element otherwise. A tile lies within one block of the
placement, so its tokens are consecutive in the sequence and the tile's first and last
position and document id say which case it is, as for the single-process document mask
(models/document_attention.py). The gradient of the gathered keys and values is
reduce-scattered back to their ranks (all_gather.py's gather_keys_values).

The mask is built once per micro batch (the placement's `derived` cache) and the shapes are
the same in every micro batch (every rank holds S / cp tokens), so flex_attention compiles
once. On the three document-masked 32k samples of scripts/gpu/dcp_compare.sh this ran 1.10-
1.36x faster than the two varlen flash calls of dynamic.py (2 x H100, BENCHMARKS.md), which
still serve --attention-backend flash or fused. The gather moves every block where the
varlen route moves only those read (on those samples at cp 2, rank 0 read 81-88% of rank 1's
blocks and rank 1 6-19% of rank 0's), and nothing overlaps it.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from megadyn.core.context_parallel.all_gather import gather_keys_values

TILE = 128
"""flex_attention's tile (its default block size)."""


def uses_flex(q: torch.Tensor, kernel: str | None, block_size: int) -> bool:
    """The flex path runs for q [b, n, s, d]: CUDA, 16-bit, the automatic kernel choice, and
    blocks of whole tiles."""
    fused = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    return fused and kernel is None and block_size % TILE == 0


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query tile: how many key tiles are set in `blocks` [b, nq, nk], and their indices
    first (ascending), as BlockMask wants them ([b, 1, nq] and [b, 1, nq, nk], int32)."""
    count = blocks.sum(-1, dtype=torch.int32)
    order = blocks.to(torch.int8).argsort(dim=-1, descending=True, stable=True)
    return count.unsqueeze(1), order.to(torch.int32).unsqueeze(1)


def _tiles(pos: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pos` padded to whole tiles (its last position repeated), and each tile's first and
    last position."""
    pad = -pos.numel() % tile
    padded = torch.cat([pos, pos[-1:].expand(pad)])
    tiles = padded.view(-1, tile)
    return padded, tiles[:, 0], tiles[:, -1]


def tile_mask(ids: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, tile: int = TILE):
    """flex_attention's BlockMask of queries at positions `q_pos` [sq] over keys at `k_pos`
    [sk] for document ids `ids` [b, S] (non-decreasing along each sample): a key is visible
    when it is not later and in the same document. Each tile of `tile` queries or keys must
    hold consecutive positions (the last tile may be short); memory O(b sq sk / tile^2)."""
    b, sizes = ids.shape[0], (q_pos.numel(), k_pos.numel())
    q_pos, qf, ql = _tiles(q_pos, tile)
    k_pos, kf, kl = _tiles(k_pos, tile)
    dqf, dql, dkf, dkl = (ids[:, p] for p in (qf, ql, kf, kl))  # [b, tiles]
    earlier = (kl.unsqueeze(0) < qf.unsqueeze(1)).unsqueeze(0)  # [1, nq, nk]: key tile before
    same = (kf.unsqueeze(0) == qf.unsqueeze(1)).unsqueeze(0)  # the same positions: diagonal
    # ids grow along positions: an earlier key tile shares a document with a query tile iff
    # its last id is the query tile's first, and lies wholly in the query tile's one document
    # iff its first id is the query tile's last
    full = earlier & (dkf.unsqueeze(1) == dql.unsqueeze(2))
    partial = (same | (earlier & (dkl.unsqueeze(1) == dqf.unsqueeze(2)))) & ~full

    def visible(batch, head, q_idx, kv_idx):
        qp, kp = q_pos[q_idx], k_pos[kv_idx]
        return (kp <= qp) & (ids[batch, qp] == ids[batch, kp])

    return BlockMask.from_kv_blocks(
        *_ordered(partial.expand(b, -1, -1)), *_ordered(full.expand(b, -1, -1)),
        BLOCK_SIZE=tile, mask_mod=visible, seq_lengths=sizes,
    )  # fmt: skip


@functools.cache
def _compiled():
    return torch.compile(flex_attention, dynamic=False)


def _tiles_set(count: torch.Tensor, index: torch.Tensor, nk: int) -> torch.Tensor:
    """[b, h, nq, nk] bool from BlockMask's (count, index) of each query tile."""
    valid = torch.arange(index.shape[-1], device=index.device) < count.unsqueeze(-1)
    hits = torch.zeros(index.shape[:-1] + (nk,), dtype=torch.int32, device=index.device)
    return hits.scatter_add_(-1, index.long(), valid.to(torch.int32)) > 0


def emulated_mask(block_mask: BlockMask, sq: int, sk: int) -> torch.Tensor:
    """[b, h, sq, sk] bool: what flex_attention computes under `block_mask`: every element of
    a full tile, those of a partial tile that its mask_mod lets through, none elsewhere."""
    tile = block_mask.BLOCK_SIZE[0]
    nk = -(-sk // tile)

    def elements(tiles):
        return tiles.repeat_interleave(tile, -2).repeat_interleave(tile, -1)[..., :sq, :sk]

    partial = elements(_tiles_set(block_mask.kv_num_blocks, block_mask.kv_indices, nk))
    full = elements(_tiles_set(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nk))
    b, h = (torch.arange(n).view(-1, 1, 1, 1) for n in partial.shape[:2])
    q_idx, kv_idx = torch.arange(sq).view(-1, 1), torch.arange(sk).view(1, -1)
    return full | (partial & block_mask.mask_mod(b, h, q_idx, kv_idx))


def flex(q, k, v, block_mask: BlockMask, scale: float | None = None) -> torch.Tensor:
    """flex_attention under `block_mask`, compiled (once per shape) on CUDA; elsewhere (the
    CPU tests; flex_attention has no CPU backward) scaled_dot_product_attention under the
    elements flex_attention would compute. Grouped queries when k has fewer heads than q."""
    gqa = k.shape[1] != q.shape[1]
    if q.is_cuda:
        return _compiled()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    mask = emulated_mask(block_mask, q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _placement_mask(placement, rank: int, b: int, device, tile: int) -> BlockMask:
    key = ("flex", rank, b, device, tile)  # the same in every layer: once per micro batch
    if key not in placement.derived:
        ids = placement.document_ids  # on the host
        if ids is None:  # causal over the whole sequence: one document
            ids = torch.zeros(b, placement.seq_length, dtype=torch.long)
        q_pos = placement.token_index(rank, device)
        k_pos = torch.cat([placement.token_index(r, device) for r in range(placement.cp)])
        placement.derived[key] = tile_mask(ids.to(device), q_pos, k_pos, tile)
    return placement.derived[key]


def flex_placement_attention(q, k, v, group, placement, scale=None, tile: int = TILE):
    """Attention of this rank's queries q [b, n, s, d] over the keys and values k, v
    [b, g, s, d] of every rank, as `placement` holds them (module docstring)."""
    mask = _placement_mask(placement, dist.get_rank(group), q.shape[0], q.device, tile)
    k_all, v_all = gather_keys_values(k, v, group)
    return flex(q, k_all, v_all, mask, scale)
