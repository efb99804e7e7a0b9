"""Tensor parallelism: communication functions, layers, vocab-parallel loss, RNG streams."""

from megadyn.core.tensor_parallel.chunked_loss import chunked_output_loss
from megadyn.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megadyn.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_param,
    vocab_range,
)
from megadyn.core.tensor_parallel.mappings import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    group_rank,
    group_size,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
    scatter_to_sequence,
)
from megadyn.core.tensor_parallel.random import RNGTracker, seed_default_generator

__all__ = [
    "chunked_output_loss",
    "ColumnParallelLinear",
    "RNGTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_region",
    "gather_from_region",
    "gather_from_sequence",
    "group_rank",
    "group_size",
    "mark_param",
    "reduce_from_region",
    "reduce_scatter_to_sequence",
    "scatter_to_region",
    "scatter_to_sequence",
    "seed_default_generator",
    "vocab_parallel_cross_entropy",
    "vocab_range",
]
