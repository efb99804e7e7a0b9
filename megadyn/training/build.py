"""A layout's model: the parts one training step runs on, built from the job's config.

    parts = build_model_parts(cfg, cfg.model, groups, device)
    forward_backward(parts.ddp, groups, batches, n, config=parts.pipeline_cfg,
                     no_sync=lambda: no_sync(parts.ddp), ...)
    parts.optimizer.step()

`build_layout_parts` (layout_parts.py) builds a layout's model through here, for training
and for the benchmarks that time the trainer's step. The seed is drawn in a fixed order
(default generator, tracker, weights), so the same config gives the same weights every time.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from megadyn.core.distributed import DistributedDataParallel, default_bucket_size
from megadyn.core.hetero_groups import HeteroGroups
from megadyn.core.optimizer import MixedPrecisionOptimizer, build_optimizer
from megadyn.core.pipeline import PipelineConfig
from megadyn.core.tensor_parallel import RNGTracker, seed_default_generator
from megadyn.models import GPTConfig, build_gpt_chunks
from megadyn.training.config import MegadynConfig


@dataclass
class ModelParts:
    """What one training step under a layout runs on."""

    tracker: RNGTracker
    """This rank's tensor-parallel RNG streams (dropout, weight init)."""
    chunks: list[torch.nn.Module]
    """The model chunks this rank holds, one per virtual pipeline stage."""
    ddp: list[DistributedDataParallel]
    """One data-parallel wrapper per chunk (gradient buffers and their reductions)."""
    optimizer: MixedPrecisionOptimizer
    """The optimizer over every chunk (fp32 main weights; distributed with ZeRO-1)."""
    pipeline_cfg: PipelineConfig
    """What the pipeline schedule sends between stages."""


def build_model_parts(
    cfg: MegadynConfig,
    model_cfg: GPTConfig,
    groups,
    device,
    *,
    init_weights: bool = True,
) -> ModelParts:
    """Seed the RNG streams, then build `model_cfg`'s chunks for this rank of `groups`, their
    DDP wrappers, the optimizer and the pipeline config. Without `init_weights` the weights are
    left uninitialized (they come from a reshard or a checkpoint).

    `groups` is a grid's `ParallelGroups` or a heterogeneous layout's `HeteroGroups`: the model
    is then this rank's stage of its replica (a pipeline template's layers), and the DDP
    wrappers sum each gradient over its layer range's reduce group (and shard the optimizer
    over it with --use-distributed-optimizer; see megadyn/core/hetero_groups.py)."""
    t, p = cfg.training, cfg.parallel
    hetero = groups if isinstance(groups, HeteroGroups) else None
    # the ranks the optimizer shards over, as the state description counts them (replicas of a
    # heterogeneous layout, its dp; dp x cp of a grid): the bucket size follows it
    shards = groups.layout.dp * groups.layout.cp
    if hetero is not None:
        groups = hetero.replica
    seed_default_generator(t.seed, groups.pp_rank, device)
    tracker = RNGTracker.create(t.seed, groups.tp_rank, groups.pp_rank, device)
    chunks = build_gpt_chunks(
        model_cfg,
        groups,
        recompute_cfg=t.recompute,
        tracker=tracker,
        seed=t.seed if init_weights else None,
        device=device,
        stage_layers=hetero.stage_layers if hetero else None,
    )
    ddp = [
        DistributedDataParallel(
            c,
            groups.dp_cp_group,  # weights are replicated over dp x cp (a replica: dp 1)
            overlap_grad_reduce=p.overlap_grad_reduce,
            use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
            overlap_param_gather=p.overlap_param_gather,
            bucket_size=default_bucket_size(p.overlap_grad_reduce, shards),
            shard_group=groups.intra_distopt_group,  # --num-distributed-optimizer-instances
            replica_group=groups.inter_distopt_group,
            grad_groups=_grad_groups(c, hetero),
            data_parallel_sharding_strategy=p.data_parallel_sharding_strategy,
        )
        for c in chunks
    ]
    stats_group = hetero.stats_group if hetero else None
    optimizer = build_optimizer(chunks, ddp, groups, cfg.optimizer, stats_group=stats_group)
    pipeline_cfg = PipelineConfig(
        hidden_size=model_cfg.hidden_size,
        dtype=model_cfg.params_dtype,
        scatter_gather_tensors_in_pipeline=p.scatter_gather_tensors_in_pipeline,
        cp_block_size=None if model_cfg.cp_placement == "static" else model_cfg.cp_block_size,
        cp_balance=model_cfg.cp_placement == "dynamic",
    )
    return ModelParts(tracker, chunks, ddp, optimizer, pipeline_cfg)


def _grad_groups(chunk, hetero: HeteroGroups | None) -> dict | None:
    """Each parameter's reduce group in a heterogeneous layout (None on a grid)."""
    if hetero is None:
        return None
    return {p: hetero.grad_group_of(name) for name, p in chunk.named_parameters()}


def no_sync(ddp: list[DistributedDataParallel]) -> contextlib.ExitStack:
    """Every wrapper's `no_sync` at once: gradients accumulate over micro batches without
    being reduced until the last one."""
    stack = contextlib.ExitStack()
    for d in ddp:
        stack.enter_context(d.no_sync())
    return stack
