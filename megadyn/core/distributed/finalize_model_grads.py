"""After the last micro batch's backward: finish every gradient reduction the step needs.

    finalize_model_grads(chunks, groups)      # then optimizer.step()

1. data parallelism: wait for (or launch) each chunk's bucket reductions;
2. sequence parallelism: all-reduce over tp the gradients of tp-replicated params that saw only
   this rank's part of the sequence (`param.sequence_parallel`, layer norms, row biases);
3. tied embeddings over pipeline stages: all-reduce the word-embedding gradient of the first
   stage with its tied copy on the last stage (`param.shared_embedding`) over the embedding
   group, so both copies take the same step.

The dp reduction comes first, as in Megatron. With the distributed optimizer it leaves only this
dp rank's part of each bucket valid, which is enough: tp ranks share a buffer layout, and the tied
embedding sits alone in a bucket on both stages (see `DistributedDataParallel`). Under
--data-parallel-sharding-strategy optim_grads step 2 all-reduces the params' pieces of the
gradient shards (the same pieces on every tp rank); step 3 does not run there (pp 1 only).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from megadyn.core.groups import ParallelGroups


def tied_embedding_weight(module: nn.Module) -> nn.Parameter | None:
    """The weight of `module` that is tied to a copy on another pipeline stage, if any.

    On the last stage that is the parameter marked `shared_embedding`. On the first stage the
    model says which parameter it is through Megatron's `shared_embedding_or_output_weight()`
    (and `share_embeddings_and_output_weights`, when present, must be true).
    """
    module = getattr(module, "module", module)
    for param in module.parameters():
        if getattr(param, "shared_embedding", False):
            return param
    getter = getattr(module, "shared_embedding_or_output_weight", None)
    if callable(getter) and getattr(module, "share_embeddings_and_output_weights", True):
        return getter()
    return None


def _grad(param: nn.Parameter) -> torch.Tensor:
    staging = getattr(param, "grad_staging", None)  # optim_grads: this rank's piece only
    if staging is not None:
        return staging.shard_grad(param)
    return param.main_grad if hasattr(param, "main_grad") else param.grad


def allreduce_sequence_parallel_grads(chunks: Sequence[nn.Module], tp_group) -> None:
    """Sum the grads of `sequence_parallel` params over `tp_group` (one coalesced all-reduce)."""
    grads = [
        g
        for chunk in chunks
        for p in chunk.parameters()
        if p.requires_grad
        and getattr(p, "sequence_parallel", False)
        and (g := _grad(p)) is not None
    ]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=tp_group)
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


def allreduce_embedding_grads(chunks: Sequence[nn.Module], groups: ParallelGroups) -> None:
    """Sum the tied word-embedding grads of the first and last pipeline stage."""
    if groups.pp_size == 1 or not (groups.is_first_stage or groups.is_last_stage):
        return
    chunk = chunks[0] if groups.is_first_stage else chunks[-1]
    weight = tied_embedding_weight(chunk)
    if weight is not None:
        dist.all_reduce(_grad(weight), group=groups.embedding_group)


def finalize_model_grads(chunks: Sequence[nn.Module], groups: ParallelGroups) -> None:
    """Make every gradient final for the optimizer step (see the module docstring).

    `chunks` are this rank's model chunks, wrapped in `DistributedDataParallel` (or plain
    modules, whose `param.grad` is then used and no dp reduction happens).
    """
    for chunk in chunks:
        finish = getattr(chunk, "finish_grad_sync", None)
        if finish is not None:
            finish()
    if groups.layout.sequence_parallel and groups.tp_size > 1:
        allreduce_sequence_parallel_grads(chunks, groups.tp_group)
    allreduce_embedding_grads(chunks, groups)
