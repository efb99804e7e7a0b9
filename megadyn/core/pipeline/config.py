"""Configuration of the pipeline schedules: one dataclass, one docstring per field.

    config = PipelineConfig(hidden_size=cfg.hidden_size, dtype=cfg.params_dtype)
    config = PipelineConfig(hidden_size=..., scatter_gather_tensors_in_pipeline=False)

The layout (pp, vpp, tp, sequence parallelism) is not repeated here: the schedules read it from
the `ParallelGroups` they are given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PipelineConfig:
    hidden_size: int
    """Width h of the activations sent between stages ([s(/tp), b, h]) (--hidden-size)."""
    dtype: torch.dtype = torch.float32
    """Dtype of the activations and gradients sent between stages: the model's dtype."""
    scatter_gather_tensors_in_pipeline: bool = True
    """Without sequence parallelism, each tp rank sends 1/tp of an activation (or gradient) to
    its peer of the next stage, which all-gathers it over tp (PTD-P paper, section 4.1)
    (off: --no-scatter-gather-tensors-in-pipeline)."""
    cp_block_size: int | None = None
    """Under context parallelism, the block size of --cp-placement dynamic: each micro batch's
    sequence is placed over the cp ranks in blocks of this many tokens (context_parallel's
    placement.py); None: the static split (--cp-placement static)."""
    cp_balance: bool = True
    """With `cp_block_size`: balance each micro batch's attention work (--cp-placement
    dynamic); False: the static split's blocks (--cp-placement static_blocks)."""
    deallocate_pipeline_outputs: bool = True
    """Free the data of an activation once it is sent, keeping only its autograd graph
    (Megatron's `deallocate_output_tensor`); the backward then goes through the engine
    directly."""
