"""The target layout of a conversion: checked with the state description, recorded as flags.

    target = Target(tp=2, pp=2)
    layout = check_layout(cfg, target)       # ConversionError naming the flag if it cannot load
    args = job_args(cfg, target)             # megadyn.json 'args' (dump_args of a MegadynConfig)
    flags = model_flags(cfg)                 # pretrain_gpt.py flags that build this model

Checkpoints are layout-free, so a layout is only a promise that the checkpoint loads: every
rank's piece of every weight exists (heads, query groups, FFN and layers divide; every
tensor-parallel rank gets vocabulary rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megadyn.convert.errors import ConversionError
from megadyn.core.layout import Layout, LayoutError
from megadyn.core.optimizer import OptimizerConfig
from megadyn.core.tensor_parallel.layers import vocab_range
from megadyn.models.config import GPTConfig
from megadyn.models.sharding import chunk_param_names, param_specs, tp_piece
from megadyn.training.arguments import dump_args
from megadyn.training.config import DataConfig, MegadynConfig, ParallelConfig


@dataclass(frozen=True)
class Target:
    """The layout a converted checkpoint is meant for (--target-* flags)."""

    tp: int = 1
    """--target-tensor-parallel-size."""
    pp: int = 1
    """--target-pipeline-parallel-size."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """--target-num-layers-per-virtual-pipeline-stage."""
    dp: int = 1
    """--target-data-parallel-size."""
    use_distributed_optimizer: bool = False
    """--use-distributed-optimizer."""

    @property
    def flags(self) -> str:
        return f"--target-tensor-parallel-size {self.tp} --target-pipeline-parallel-size {self.pp}"

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tp=self.tp,
            pp=self.pp,
            num_layers_per_virtual_pipeline_stage=self.num_layers_per_virtual_pipeline_stage,
        )


def check_layout(cfg: GPTConfig, target: Target) -> Layout:
    """The layout `target` for `cfg`, after checking every rank's piece of every weight."""
    nl = target.num_layers_per_virtual_pipeline_stage
    per_stage = cfg.num_layers // max(target.pp, 1)
    if nl is not None and (nl < 1 or per_stage % nl):
        raise ConversionError(
            f"--target-num-layers-per-virtual-pipeline-stage {nl} must divide the layers per "
            f"pipeline stage ({cfg.num_layers} / {target.pp})"
        )
    try:
        vpp = target.parallel_config().virtual_stages(cfg.num_layers)
        layout = Layout(tp=target.tp, pp=target.pp, dp=target.dp, vpp=vpp)
        layout.validate(
            num_layers=cfg.num_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_query_groups=cfg.num_query_groups,
        )
    except LayoutError as e:
        raise ConversionError(f"{target.flags}: {e}") from e
    specs = param_specs(cfg)
    for pp_rank in range(layout.pp):
        for chunk in range(layout.vpp):
            for name in chunk_param_names(cfg, layout, pp_rank, chunk):
                for tp_rank in range(layout.tp):
                    try:
                        tp_piece(specs[name], cfg, layout.tp, tp_rank)
                    except ValueError as e:
                        raise ConversionError(f"{target.flags}: {e}") from e
    padded = cfg.padded_vocab_size(layout.tp)
    for tp_rank in range(layout.tp):
        start, end = vocab_range(cfg.vocab_size, padded, tp_rank, layout.tp)
        if end <= start:
            raise ConversionError(
                f"--make-vocab-size-divisible-by {cfg.make_vocab_size_divisible_by}: a vocabulary "
                f"of {cfg.vocab_size} padded to {padded} leaves tensor-parallel rank {tp_rank} of "
                f"{layout.tp} no rows; lower it or --target-tensor-parallel-size"
            )
    return layout


def job_args(cfg: GPTConfig, target: Target, data: DataConfig | None = None) -> dict:
    """megadyn.json 'args' of a converted checkpoint: the model, the target layout, the dtype."""
    optimizer = OptimizerConfig(
        bf16=cfg.params_dtype == torch.bfloat16,
        fp16=cfg.params_dtype == torch.float16,
        use_distributed_optimizer=target.use_distributed_optimizer,
    )
    job = MegadynConfig(
        model=cfg,
        parallel=target.parallel_config(),
        optimizer=optimizer,
        data=data or DataConfig(),
    )
    return dump_args(job)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def model_flags(cfg: GPTConfig) -> list[str]:
    """pretrain_gpt.py flags that build `cfg`'s model (the tokenizer gives --vocab-size)."""
    flags = [
        "--num-layers", str(cfg.num_layers),
        "--hidden-size", str(cfg.hidden_size),
        "--ffn-hidden-size", str(cfg.ffn_size),
        "--num-attention-heads", str(cfg.num_attention_heads),
        "--max-position-embeddings", str(cfg.max_position_embeddings),
        "--position-embedding-type", cfg.position_embedding_type,
        "--normalization", cfg.normalization,
        "--norm-epsilon", repr(cfg.norm_epsilon),
        "--make-vocab-size-divisible-by", str(cfg.make_vocab_size_divisible_by),
    ]  # fmt: skip
    if cfg.num_query_groups is not None and cfg.num_query_groups != cfg.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(cfg.num_query_groups)]
    if cfg.position_embedding_type == "rope":
        flags += ["--rotary-base", _number(cfg.rotary_base)]
    if cfg.activation == "swiglu":
        flags.append("--swiglu")
    if cfg.openai_gelu:
        flags.append("--openai-gelu")
    if not cfg.add_bias_linear:
        flags.append("--disable-bias-linear")
    if cfg.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    if cfg.params_dtype == torch.bfloat16:
        flags.append("--bf16")
    elif cfg.params_dtype == torch.float16:
        flags.append("--fp16")
    return flags
