"""All-gather attention over the cp group (--cp-comm-type all_gather): every rank gathers the
keys and values of the whole sequence, then attends with its own queries under the causal mask
of their global positions. Simpler than the ring and one collective per layer, at the cost of
holding the whole sequence's keys and values; the backward reduce-scatters their gradients.
With attention dropout (`dropout` = (p, seed), dropout.py) the attention runs through blocks.py's
math as one block, its mask drawn by the generator of (seed, cp rank, step 0), and autograd keeps
the mask for the backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megadyn.core.context_parallel.blocks import block_forward
from megadyn.core.context_parallel.dropout import block_dropout
from megadyn.core.context_parallel.sequence import local_positions, split_sequence
from megadyn.core.tensor_parallel import gather_from_sequence


def gather_keys_values(k, v, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's keys and values k, v [b, g, s, d] over `group`, rank after rank
    ([b, g, cp * s, d] each); their gradients are reduce-scattered back."""
    kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4)  # [s, 2, b, g, d]: sequence first
    kv = gather_from_sequence(kv, group)  # [cp * s, 2, b, g, d], rank after rank
    k_all, v_all = kv.permute(1, 2, 3, 0, 4).unbind(0)  # [b, g, cp * s, d]
    return k_all, v_all


def all_gather_attention(
    q, k, v, group, scale: float | None = None, document_ids=None, dropout=None
) -> torch.Tensor:
    """Causal attention of this rank's queries q [b, n, s, d] over the whole sequence, whose
    keys and values k, v [b, g, s, d] are spread over `group` (the cp group); within
    documents when `document_ids` [b, S] (the whole sequence's) is given, with attention
    dropout when `dropout` is (p, seed)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    s = q.shape[2]
    k_all, v_all = gather_keys_values(k, v, group)
    seq = s * cp
    q_pos = local_positions(seq, rank, cp, q.device)  # [s]
    k_pos = torch.cat([local_positions(seq, r, cp, q.device) for r in range(cp)])  # [cp * s]
    visible = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [s, cp * s]
    if document_ids is not None:
        q_doc = split_sequence(document_ids, rank, cp, dim=1)  # [b, s]
        k_doc = torch.cat([split_sequence(document_ids, r, cp, dim=1) for r in range(cp)], 1)
        visible = (visible & (q_doc.unsqueeze(-1) == k_doc.unsqueeze(-2))).unsqueeze(1)
    if dropout is not None:
        p, seed = dropout
        b, n = q.shape[:2]
        drop = block_dropout(seed, p, rank, 0, (b, n, s, seq), q.device)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        out, _ = block_forward(q, k_all, v_all, False, scale, visible, drop)
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(
        q, k_all, v_all, attn_mask=visible, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
