"""Context parallelism: each sequence split over the cp ranks, attention over all of it.

    batch = split_batch(batch, groups.cp_rank, groups.cp_size)   # the data: two chunks per rank
    out = context_parallel_attention(q, k, v, groups.cp_group, "p2p")  # in the attention layer

Under --cp-comm-type a2a (all_to_all.py) a rank trades its part of the sequence for a share of
the heads before attention, attends over the whole sequence as without cp, and trades back:

    q, k, v = scatter_heads([q, k, v], groups.cp_group)   # [b, h/cp, S, d]
    out = gather_heads(attention(q, k, v), groups.cp_group)

Under --cp-placement dynamic (placement.py, dynamic.py) the split is chosen per micro batch
instead: blocks of --cp-block-size tokens placed so that every rank's attention work is equal.

    batch = split_batch_dynamic(batch, groups.cp_rank, groups.cp_size, block_size)

Layers other than attention work on their tokens alone, so only attention (and the loss, which
is summed over the cp group) knows the sequence is split. Weights are replicated over cp;
gradients reduce over dp x cp (`ParallelGroups.dp_cp_group`).
"""

from megadyn.core.context_parallel.all_gather import all_gather_attention
from megadyn.core.context_parallel.all_to_all import gather_heads, scatter_heads
from megadyn.core.context_parallel.comm import RingExchange, all_reduce_sum
from megadyn.core.context_parallel.documents import PackedDocuments, device_ids
from megadyn.core.context_parallel.dropout import block_dropout, call_seed
from megadyn.core.context_parallel.dynamic import dynamic_attention
from megadyn.core.context_parallel.kernels import block_kernels, kernel_for_backend
from megadyn.core.context_parallel.placement import (
    BlockPlacement,
    place_blocks,
    split_batch_dynamic,
)
from megadyn.core.context_parallel.ring import ring_attention
from megadyn.core.context_parallel.sequence import (
    chunk_ids,
    local_positions,
    split_batch,
    split_sequence,
)

CP_COMM_TYPES = {"p2p": ring_attention, "all_gather": all_gather_attention}
"""--cp-comm-type: how keys and values reach the queries of other cp ranks."""


def context_parallel_attention(
    q,
    k,
    v,
    group,
    comm_type: str = "p2p",
    scale=None,
    document_ids=None,
    backend: str = "auto",
    dropout_p: float = 0.0,
):
    """Causal attention of this cp rank's queries q [b, n, s, d] over the whole sequence; k and
    v [b, g, s, d] are this rank's part (sequence.py's two chunks). With `document_ids`
    [b, S] (the whole sequence's, on every cp rank; or documents.py's PackedDocuments, which
    carry a host copy) a query sees keys of its document only.
    `backend` (--attention-backend) picks the ring's block kernel (kernels.py); the
    all-gather variant runs torch's SDPA with the mask of the global positions. With
    `dropout_p` > 0 one seed is drawn from the current stream (call inside the tracker's
    fork) and the attention runs through the math kernels (dropout.py)."""
    dropout = (dropout_p, call_seed(q.device)) if dropout_p > 0.0 else None
    if comm_type == "p2p":
        kernel = kernel_for_backend(backend)
        return ring_attention(q, k, v, group, scale, document_ids, kernel, dropout)
    return CP_COMM_TYPES[comm_type](q, k, v, group, scale, device_ids(document_ids), dropout)


__all__ = [
    "BlockPlacement",
    "dynamic_attention",
    "place_blocks",
    "split_batch_dynamic",
    "CP_COMM_TYPES",
    "PackedDocuments",
    "RingExchange",
    "all_gather_attention",
    "all_reduce_sum",
    "block_dropout",
    "block_kernels",
    "call_seed",
    "gather_heads",
    "scatter_heads",
    "chunk_ids",
    "context_parallel_attention",
    "kernel_for_backend",
    "local_positions",
    "ring_attention",
    "split_batch",
    "split_sequence",
]
