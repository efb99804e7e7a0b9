"""The model of tools/bench_gpt.py: pretrain_gpt.py's architecture flags, the GPTConfig that
pretrain_gpt.py's own parser builds from them, and the model's FLOPs and parameter count.

    add_model_args(parser)                  # --swiglu, --normalization, --num-query-groups, ...
    cfg = model_config(args)                # GPTConfig, through megadyn/training/arguments.py
    model_record(args)                      # {"params": ..., "flops_per_iter": ..., ...}

The shape flags keep the reference script's short names (--layers, --hidden, --heads, --seq,
--vocab) beside pretrain_gpt.py's (--num-layers, ...); the rest have pretrain_gpt.py's names and
meanings. The reference script's job is kept: untied embeddings, no dropout, bf16 weights.
A Llama-3-style model:

    tools/bench_gpt.py --layers 16 --hidden 2048 --heads 32 --ffn-hidden-size 8192 --vocab 128256 \
        --swiglu --normalization RMSNorm --position-embedding-type rope --rotary-base 500000 \
        --disable-bias-linear --group-query-attention --num-query-groups 8 \
        --untie-embeddings-and-output-weights
"""

from __future__ import annotations

import argparse

from megadyn.models import GPTConfig
from megadyn.models.flops import model_flops_per_iteration
from megadyn.models.pointwise import Fusions
from megadyn.models.sharding import num_params
from megadyn.training.arguments import ConfigError, parse_config

PART_FLAGS = (
    "--no-norm-fusion",
    "--no-bias-swiglu-fusion",
    "--no-rope-fusion",
    "--no-bias-dropout-fusion",
)
"""pretrain_gpt.py's switches of --pointwise-fusion's parts, passed through as given."""


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The shape flags (reference names, pretrain_gpt.py's as aliases) and pretrain_gpt.py's
    architecture flags."""
    p.add_argument("--layers", "--num-layers", dest="layers", type=int, default=24)
    p.add_argument("--hidden", "--hidden-size", dest="hidden", type=int, default=2048)
    p.add_argument("--heads", "--num-attention-heads", dest="heads", type=int, default=16)
    p.add_argument("--seq", "--seq-length", dest="seq", type=int, default=2048)
    p.add_argument("--vocab", "--vocab-size", dest="vocab", type=int, default=50304)
    g = p.add_argument_group("architecture (pretrain_gpt.py's flags; default: the GPT-2 block)")
    g.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="MLP width (default 4h; ~8h/3 under --swiglu)",
    )
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP instead of GeLU")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=None)
    g.add_argument(
        "--position-embedding-type",
        choices=["learned_absolute", "rope"],
        default="learned_absolute",
    )
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in linear layers")
    g.add_argument("--group-query-attention", action="store_true", help="use --num-query-groups")
    g.add_argument(
        "--num-query-groups",
        type=int,
        default=None,
        help="key/value heads under --group-query-attention",
    )
    g.add_argument(
        "--pointwise-fusion",
        action="store_true",
        help="norms, residual adds, SwiGLU and RoPE through torch.compile (CUDA)",
    )
    for flag in PART_FLAGS:
        g.add_argument(flag, action="store_true", help="under --pointwise-fusion: that part eager")
    g.add_argument(
        "--cross-entropy-chunks",
        type=int,
        default=None,
        help="the output layer and its loss over N token chunks: no whole logits held",
    )
    g.add_argument(
        "--keep-fc2-input",
        action="store_true",
        help="under --pointwise-fusion with SwiGLU: fc2 keeps its input from the forward "
        "instead of computing it again in the backward (more memory, one pass less)",
    )
    g.add_argument(
        "--keep-norm-outputs",
        action="store_true",
        help="under --pointwise-fusion: linear_qkv and linear_fc1 keep their inputs (the norms' "
        "outputs) instead of computing them again in the backward (more memory, two passes less)",
    )
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="always on here (the reference script's job); accepted as pretrain_gpt.py takes it",
    )


def check_model_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse what pretrain_gpt.py would silently ignore, and a model it would not build."""
    if a.num_query_groups is not None and not a.group_query_attention:
        p.error(
            "--num-query-groups: add --group-query-attention (without it pretrain_gpt.py ignores the groups)"
        )
    try:
        model_config(a)
    except ConfigError as err:
        p.error(str(err))


def pretrain_argv(a: argparse.Namespace) -> list[str]:
    """pretrain_gpt.py's command line for the model of `a` (and the few flags its parser needs)."""
    argv = ["--num-layers", a.layers, "--hidden-size", a.hidden, "--num-attention-heads", a.heads]
    argv += ["--seq-length", a.seq, "--max-position-embeddings", a.seq, "--vocab-size", a.vocab]
    argv += ["--micro-batch-size", a.mbs, "--global-batch-size", a.gbs, "--train-iters", 1]
    argv += ["--lr", "1e-4", "--bf16", "--hidden-dropout", 0, "--attention-dropout", 0]
    argv += ["--untie-embeddings-and-output-weights", "--rotary-base", a.rotary_base]
    argv += [
        "--normalization",
        a.normalization,
        "--position-embedding-type",
        a.position_embedding_type,
    ]
    for flag, value in (
        ("--ffn-hidden-size", a.ffn_hidden_size),
        ("--norm-epsilon", a.norm_epsilon),
        ("--num-query-groups", a.num_query_groups),
        ("--attention-backend", a.attention_backend),
        ("--cp-comm-type", a.cp_comm_type),
        ("--cp-placement", a.cp_placement),
        ("--cp-block-size", a.cp_block_size),
        ("--cross-entropy-chunks", a.cross_entropy_chunks),
        ("--tp-comm-overlap-transport", a.tp_comm_overlap_transport),
        ("--fp8-format", a.fp8_format),
        ("--fp8-recipe", a.fp8_recipe if a.fp8_format else None),
    ):
        argv += [flag, value] if value is not None else []
    for flag, on in (
        ("--swiglu", a.swiglu),
        ("--disable-bias-linear", a.disable_bias_linear),
        ("--group-query-attention", a.group_query_attention),
        ("--tp-comm-overlap", a.tp_comm_overlap),
        ("--no-gradient-accumulation-fusion", a.no_grad_accumulation_fusion),
        ("--cross-entropy-loss-fusion", a.fused_loss == "on"),
        ("--no-cross-entropy-loss-fusion", a.fused_loss == "off"),
        ("--pointwise-fusion", a.pointwise_fusion),
        ("--no-fp8-weight-cache", getattr(a, "no_fp8_weight_cache", False)),
        ("--keep-fc2-input", a.keep_fc2_input),
        ("--keep-norm-outputs", a.keep_norm_outputs),
        *((flag, getattr(a, _dest(flag))) for flag in PART_FLAGS),
    ):
        argv += [flag] if on else []
    return [str(x) for x in argv]


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def model_config(a: argparse.Namespace) -> GPTConfig:
    """The GPTConfig that pretrain_gpt.py builds for the model of `a`."""
    return parse_config(pretrain_argv(a), world_size=1).model


def architecture(cfg: GPTConfig) -> str:
    """'POSITIONS/NORM/ACTIVATION/BIASES', e.g. 'rope/RMSNorm/swiglu/nobias' for Llama."""
    bias = "bias" if cfg.add_bias_linear else "nobias"
    return f"{cfg.position_embedding_type}/{cfg.normalization}/{cfg.activation}/{bias}"


def model_record(a: argparse.Namespace) -> dict:
    """The model's fields of the JSON record: its shape beyond the reference fields, the
    regions --pointwise-fusion compiles ('norm+swiglu+rope+residual', None without it; on
    CUDA), its parameter count and its FLOPs per iteration (models/flops.py; the vocabulary
    as one rank pads it, as the reference script counts)."""
    cfg = model_config(a)
    return dict(
        arch=architecture(cfg),
        pointwise_fusion=Fusions.from_config(cfg).label,
        heads=cfg.num_attention_heads,
        query_groups=cfg.query_groups,
        ffn=cfg.ffn_size,
        vocab=cfg.vocab_size,
        params=num_params(cfg),
        flops_per_iter=model_flops_per_iteration(cfg, a.gbs, a.seq),
    )
