"""Megatron-LM's command line, translated into `MegadynConfig` and checked before training starts.

    cfg = parse_args(sys.argv[1:], world_size=int(os.environ["WORLD_SIZE"]))
    wandb_config = dump_args(cfg)            # flat {"training.micro_batch_size": 2, ...}

Flags keep Megatron-LM's names, and its defaults, where the meaning is the same; megadyn's own
are `--ckpt-keep-last` and the `--elastic-*` group. Each flag writes one config field
(`dest="<section>.<field>"`) and takes its help text from that field's docstring, so the
dataclasses in config.py are the one description of the job. Everything that cannot run raises
`ConfigError` whose message starts with the flag to change (the checks: validation.py).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from megadyn.core.distributed.sharded_grads import STRATEGIES
from megadyn.core.optimizer import OptimizerConfig
from megadyn.core.recompute import RecomputeConfig
from megadyn.data import TOKENIZER_TYPES
from megadyn.models.config import GPTConfig
from megadyn.training.checkpoint import checkpoint_at_step
from megadyn.training.config import (
    LR_DECAY_STYLES,
    WD_INCR_STYLES,
    WSD_DECAY_STYLES,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    ElasticConfig,
    LoggingConfig,
    MegadynConfig,
    ParallelConfig,
    SchedulerConfig,
    TrainingConfig,
    field_docs,
)
from megadyn.training.microbatches import MicroBatchCalculator
from megadyn.training.validation import validate

__all__ = [
    "ConfigError",
    "build_parser",
    "distributed_timeout",
    "dump_args",
    "parse_args",
    "parse_config",
    "validate",
]

GPT2_VOCAB_SIZE = 50257
"""Tokens of the GPT-2 BPE vocabulary (GPT2BPETokenizer)."""


class _Group:
    """Adds flags of one config section: dest `<section>.<field>`, help from the field's docstring."""

    def __init__(self, parser: argparse.ArgumentParser, title: str, section: str, cls: type):
        self.group = parser.add_argument_group(title)
        self.section, self.docs = section, field_docs(cls)
        self.defaults = {
            f.name: f.default
            for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING
        }

    def __call__(self, flag: str, name: str | None = None, **kw: Any) -> None:
        name = name or flag.removeprefix("--").replace("-", "_")
        doc = self.docs[name].replace(f" ({flag})", "")  # the flag is printed beside it anyway
        kw.setdefault("help", doc.replace("%", "%%"))
        if kw.get("action") not in ("store_true", "store_false"):
            kw.setdefault("default", self.defaults.get(name))
            if "choices" not in kw:
                kw.setdefault("metavar", name.upper())
        self.group.add_argument(flag, dest=f"{self.section}.{name}", **kw)


def build_parser() -> argparse.ArgumentParser:
    """The full command line of pretrain_gpt.py, one group of flags per config section."""
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Train a GPT model with tensor, pipeline and data parallelism (megadyn).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
        exit_on_error=False,
    )
    _add_network_args(p)
    _add_parallel_args(p)
    _add_training_args(p)
    _add_optimizer_args(p)
    _add_scheduler_args(p)
    _add_data_args(p)
    _add_checkpoint_args(p)
    _add_logging_args(p)
    return p


def _add_network_args(p: argparse.ArgumentParser) -> None:
    m = _Group(p, "model", "model", GPTConfig)
    m("--num-layers", type=int, default=None)
    m("--hidden-size", type=int, default=None)
    m("--ffn-hidden-size", type=int)
    m("--num-attention-heads", type=int, default=None)
    m("--num-query-groups", type=int, default=1)
    m("--max-position-embeddings", type=int, default=None)
    m("--position-embedding-type", choices=["learned_absolute", "rope"])
    m("--rotary-base", type=int, default=10000)
    m("--reset-position-ids", action="store_true")
    m("--normalization", choices=["LayerNorm", "RMSNorm"])
    m("--norm-epsilon", type=float)
    m("--disable-bias-linear", "add_bias_linear", action="store_false")
    m("--untie-embeddings-and-output-weights", action="store_true")
    m("--hidden-dropout", type=float, default=0.1)
    m("--attention-dropout", type=float, default=0.1)
    m("--init-method-std", type=float)
    m("--openai-gelu", action="store_true")
    m("--make-vocab-size-divisible-by", type=int)
    m("--attention-backend", choices=["auto", "flash", "fused", "unfused", "local"])
    m("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion", action="store_false")
    m("--tp-comm-overlap", action="store_true")
    m("--tp-comm-overlap-transport", choices=["nccl", "copy-engine"])
    m("--cp-comm-type", choices=["p2p", "all_gather", "a2a"])
    m("--cp-placement", choices=["static", "dynamic", "static_blocks"])
    m("--cp-block-size", type=int)
    m("--fp8-format", choices=["e4m3", "hybrid"])
    m("--fp8-recipe", choices=["tensorwise", "rowwise"])
    m("--no-fp8-weight-cache", "fp8_weight_cache", action="store_false")
    m("--cross-entropy-loss-fusion", "fused_loss", action="store_const", const=True)
    m("--no-cross-entropy-loss-fusion", "fused_loss", action="store_const", const=False)
    m("--cross-entropy-chunks", type=int)
    m("--pointwise-fusion", action="store_true")
    m("--no-norm-fusion", "norm_fusion", action="store_false")
    m("--no-bias-swiglu-fusion", "bias_swiglu_fusion", action="store_false")
    m("--no-rope-fusion", "apply_rope_fusion", action="store_false")
    m("--keep-fc2-input", action="store_true")
    m("--keep-norm-outputs", action="store_true")
    m("--no-bias-dropout-fusion", "bias_dropout_fusion", action="store_false")
    extra = m.group.add_argument  # flags that set model fields indirectly (see _to_config)
    extra("--group-query-attention", dest="flag.gqa", action="store_true", help="Use GQA.")
    extra("--swiglu", dest="flag.swiglu", action="store_true", help="SwiGLU MLP instead of GeLU.")


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    par = _Group(p, "parallel", "parallel", ParallelConfig)
    par("--tensor-model-parallel-size", "tp", type=int)
    par("--pipeline-model-parallel-size", "pp", type=int)
    par("--num-layers-per-virtual-pipeline-stage", type=int)
    par("--sequence-parallel", action="store_true")
    par("--context-parallel-size", "cp", type=int)
    par(
        "--no-scatter-gather-tensors-in-pipeline",
        "scatter_gather_tensors_in_pipeline",
        action="store_false",
    )
    par("--overlap-grad-reduce", action="store_true")
    par("--overlap-param-gather", action="store_true")
    par("--num-distributed-optimizer-instances", type=int)
    par("--data-parallel-sharding-strategy", choices=STRATEGIES)
    par("--heterogeneous-pipelines", type=int, nargs="*", metavar="STAGES")
    par("--distributed-timeout-minutes", type=int)
    _add_elastic_args(p)


def _add_elastic_args(p: argparse.ArgumentParser) -> None:
    """megadyn's --elastic-* flags: the job runtime's and the live reconfiguration's settings."""
    el = _Group(p, "elastic", "elastic", ElasticConfig)
    el("--elastic-initial-members", "initial_members", type=int)
    el("--elastic-min-members", "min_members", type=int)
    el("--elastic-layout", "layout", choices=["auto", "pinned"])
    el("--elastic-snapshot-interval", "snapshot_interval", type=int)
    el("--elastic-snapshot-dir", "snapshot_dir")
    el("--elastic-control-interval", "control_interval", type=int)
    el("--elastic-reshard-chunk-mb", "reshard_chunk_mb", type=int)
    el("--elastic-control-port", "control_port", type=int)
    el("--elastic-heartbeat-timeout", "heartbeat_timeout", type=float)
    el("--no-elastic-fork-server", "fork_server", action="store_false")
    el("--elastic-recovery", "recovery", choices=["in-process", "restart"])
    el("--exit-signal-handler", "exit_signal_handler", action="store_true")
    el("--elastic-straggler-policy", "straggler_policy", choices=["log", "exclude", "rebalance"])


def _add_training_args(p: argparse.ArgumentParser) -> None:
    t = _Group(p, "training", "training", TrainingConfig)
    t("--micro-batch-size", type=int, default=None)
    t("--micro-batch-tokens", type=int)
    t("--dynamic-parallelism", action="store_true")
    t("--dynamic-parallelism-memory-gib", type=float)
    t("--global-batch-size", type=int, default=None)
    t("--rampup-batch-size", type=int, nargs=3, metavar=("START", "INCREMENT", "SAMPLES"))
    t("--train-iters", type=int, default=None)
    t("--train-samples", type=int)
    t("--eval-interval", type=int)
    t("--eval-iters", type=int)
    t("--exit-interval", type=int)
    t("--seed", type=int)
    t("--deterministic-mode", action="store_true")
    t("--enable-cuda-graph", action="store_true")
    t("--cuda-graph-warmup-steps", type=int)
    r = _Group(p, "activation recomputation", "recompute", RecomputeConfig)
    r("--recompute-granularity", "granularity", choices=["full", "selective"])
    r("--recompute-method", "method", choices=["uniform", "block"])
    r("--recompute-num-layers", "num_layers", type=int)


def _add_optimizer_args(p: argparse.ArgumentParser) -> None:
    o = _Group(p, "optimizer and mixed precision", "optimizer", OptimizerConfig)
    o("--lr", type=float, default=None)
    o("--min-lr", type=float)
    o("--weight-decay", type=float)
    o("--adam-beta1", type=float)
    o("--adam-beta2", type=float)
    o("--adam-eps", type=float)
    o("--clip-grad", type=float)
    o("--bf16", action="store_true")
    o("--fp16", action="store_true")
    o("--loss-scale", type=float)
    o("--initial-loss-scale", type=float)
    o("--min-loss-scale", type=float)
    o("--loss-scale-window", type=int)
    o("--hysteresis", type=int)
    o("--use-distributed-optimizer", action="store_true")
    o("--use-precision-aware-optimizer", action="store_true")
    o("--log-num-zeros-in-grad", action="store_true")


def _add_scheduler_args(p: argparse.ArgumentParser) -> None:
    s = _Group(p, "learning rate and weight decay schedules", "scheduler", SchedulerConfig)
    s("--lr-decay-style", choices=LR_DECAY_STYLES)
    s("--lr-decay-iters", type=int)
    s("--lr-warmup-iters", type=int)
    s("--lr-warmup-fraction", type=float)
    s("--lr-warmup-init", type=float)
    s("--lr-wsd-decay-iters", type=int)
    s("--lr-wsd-decay-style", choices=WSD_DECAY_STYLES)
    s("--start-weight-decay", type=float)
    s("--end-weight-decay", type=float)
    s("--weight-decay-incr-style", choices=WD_INCR_STYLES)
    s("--override-opt_param-scheduler", action="store_true")
    s("--use-checkpoint-opt_param-scheduler", action="store_true")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    d = _Group(p, "data and tokenizer", "data", DataConfig)
    d("--data-path", nargs="*")
    d("--split")
    d("--seq-length", type=int, default=None)
    d("--mock-data", action="store_true")
    d("--tokenizer-type", choices=TOKENIZER_TYPES)
    d("--tokenizer-model")
    d("--vocab-file")
    d("--merge-file")
    d("--vocab-size", type=int)
    d("--num-workers", type=int)
    d("--data-cache-path")
    d("--reset-attention-mask", action="store_true")
    d("--eod-mask-loss", action="store_true")
    d("--sample-per-document", action="store_true")


def _add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    c = _Group(p, "checkpointing", "checkpoint", CheckpointConfig)
    c("--save")
    c("--load")
    c("--save-interval", type=int)
    c("--async-save", action="store_true")
    c("--ckpt-keep-last", "keep_last", type=int)
    c("--no-load-optim", action="store_true")
    c("--no-load-rng", action="store_true")
    c("--finetune", action="store_true")
    c("--ckpt-step", type=int)


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    lg = _Group(p, "logging", "logging", LoggingConfig)
    lg("--log-interval", type=int)
    lg("--log-throughput", action="store_true")
    lg("--timing-log-level", type=int, choices=[0, 1, 2])
    lg("--wandb-project")
    lg("--wandb-exp-name")
    lg("--wandb-save-dir")
    lg("--metrics-file")
    lg("--log-straggler", action="store_true")
    lg("--straggler-threshold", type=float)
    lg("--straggler-intervals", type=int)


def _early_flags(argv: Sequence[str]) -> argparse.Namespace:
    """The flags read before torch.distributed starts (the full parse needs the world size)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    p.add_argument("--distributed-timeout-minutes", type=int, default=None)
    p.add_argument("--deterministic-mode", action="store_true")
    try:
        return p.parse_known_args(argv)[0]
    except argparse.ArgumentError:  # parse_args reports it, naming the flag
        return argparse.Namespace(distributed_timeout_minutes=None, deterministic_mode=False)


def distributed_timeout(argv: Sequence[str]) -> timedelta:
    """--distributed-timeout-minutes of a command line."""
    minutes = _early_flags(argv).distributed_timeout_minutes
    return timedelta(minutes=max(1, minutes or ParallelConfig.distributed_timeout_minutes))


def deterministic_mode(argv: Sequence[str]) -> bool:
    """--deterministic-mode of a command line: it must act before the process group starts."""
    return _early_flags(argv).deterministic_mode


def parse_args(argv: Sequence[str] | None, world_size: int) -> MegadynConfig:
    """Parse and check a command line for a job of `world_size` processes."""
    cfg = parse_config(argv, world_size)
    validate(cfg, world_size)
    return cfg


def parse_config(argv: Sequence[str] | None, world_size: int) -> MegadynConfig:
    """Parse a command line without `validate` (megadyn/launch/replan.py changes the layout
    of a config that does not fit `world_size`, then validates it)."""
    try:
        ns, unknown = build_parser().parse_known_args(argv)
    except argparse.ArgumentError as err:
        raise ConfigError(f"{err.argument_name}: {err.message}") from err
    if unknown:
        raise ConfigError(f"{unknown[0]}: unrecognized argument (megadyn's pretrain_gpt.py)")
    return _to_config(vars(ns), world_size)


def _section(values: dict[str, Any], name: str) -> dict[str, Any]:
    prefix = name + "."
    return {k[len(prefix) :]: v for k, v in values.items() if k.startswith(prefix)}


def _to_config(values: dict[str, Any], world_size: int) -> MegadynConfig:
    """Translate parsed flags into configs, filling the defaults Megatron derives."""
    for flag, key in (
        ("--num-layers", "model.num_layers"),
        ("--hidden-size", "model.hidden_size"),
        ("--num-attention-heads", "model.num_attention_heads"),
        ("--seq-length", "data.seq_length"),
        ("--lr", "optimizer.lr"),
    ):
        if values[key] is None:
            raise ConfigError(f"{flag} is required")
    if values["training.micro_batch_tokens"] is not None:  # it replaces --micro-batch-size
        if values["training.micro_batch_size"] not in (None, 1):
            raise ConfigError("--micro-batch-size: drop it under --micro-batch-tokens")
        values["training.micro_batch_size"] = 1
    if values["training.micro_batch_size"] is None:
        raise ConfigError("--micro-batch-size is required (or --micro-batch-tokens)")
    if values["parallel.heterogeneous_pipelines"] is not None:
        values["parallel.heterogeneous_pipelines"] = tuple(
            values["parallel.heterogeneous_pipelines"]
        )
    parallel = ParallelConfig(**_section(values, "parallel"))
    elastic = ElasticConfig(**_section(values, "elastic"))
    try:
        optimizer = OptimizerConfig(**_section(values, "optimizer"))
    except ValueError as err:
        raise ConfigError.from_error(err) from err
    data = _section(values, "data")
    data["data_path"] = tuple(data["data_path"] or ()) or None
    data = DataConfig(**data)
    training = _training(values, parallel, elastic.members(world_size))

    model = _section(values, "model")
    flags = _section(values, "flag")
    if not flags["gqa"]:
        model["num_query_groups"] = None
    if flags["swiglu"]:
        model["activation"] = "swiglu"
        if model["ffn_hidden_size"] is None:  # Megatron: ~8h/3, a multiple of 64
            model["ffn_hidden_size"] = int(4 * model["hidden_size"] * 2 / 3 / 64) * 64
    model["max_position_embeddings"] = model["max_position_embeddings"] or data.seq_length
    model["rotary_base"] = float(model["rotary_base"])
    model["vocab_size"] = _vocab_size(data)
    model["params_dtype"] = (
        torch.bfloat16 if optimizer.bf16 else torch.float16 if optimizer.fp16 else torch.float32
    )
    try:
        model = GPTConfig(**model)
    except ValueError as err:
        raise ConfigError.from_error(err) from err

    logging = _section(values, "logging")
    logging["wandb_project"] = logging["wandb_project"] or None
    return MegadynConfig(
        model=model,
        parallel=parallel,
        elastic=elastic,
        training=training,
        optimizer=optimizer,
        scheduler=SchedulerConfig(**_section(values, "scheduler")),
        data=data,
        checkpoint=_checkpoint(values),
        logging=LoggingConfig(**logging),
    )


def _checkpoint(values: dict[str, Any]) -> CheckpointConfig:
    """--load with --ckpt-step N names the directory of iteration N (Megatron's --ckpt-step)."""
    c = _section(values, "checkpoint")
    if c["ckpt_step"] is not None:
        c["load"] = checkpoint_at_step(c["load"], c["ckpt_step"])
    return CheckpointConfig(**c)


def _training(values: dict[str, Any], parallel: ParallelConfig, members: int) -> TrainingConfig:
    t = _section(values, "training")
    if (t["train_iters"] is None) == (t["train_samples"] is None):
        raise ConfigError("--train-iters: give exactly one of --train-iters and --train-samples")
    if t["rampup_batch_size"] is not None:
        if t["train_samples"] is None:
            raise ConfigError("--rampup-batch-size needs --train-samples (as in Megatron)")
        t["rampup_batch_size"] = tuple(t["rampup_batch_size"])
    if t["global_batch_size"] is None:  # Megatron: one micro batch per step
        dp = max(1, members // max(1, parallel.tp * parallel.cp * parallel.pp))
        t["global_batch_size"] = t["micro_batch_size"] * dp
    try:
        t["recompute"] = RecomputeConfig(**_section(values, "recompute"))
    except ValueError as err:
        raise ConfigError.from_error(err) from err
    if t["train_samples"] is not None:
        batches = MicroBatchCalculator(
            t["micro_batch_size"], t["global_batch_size"], t["rampup_batch_size"]
        )
        t["train_iters"] = batches.train_iterations(t["train_samples"])
    return TrainingConfig(**t)


def _vocab_size(data: DataConfig) -> int:
    """The tokenizer's vocabulary, when the command line tells it (else GPTConfig's default,
    to be replaced by the trainer with the loaded tokenizer's size)."""
    if data.tokenizer_type == "NullTokenizer" and data.vocab_size:
        return data.vocab_size + 1  # Megatron's NullTokenizer appends an end-of-document token
    if data.tokenizer_type == "GPT2BPETokenizer":
        return GPT2_VOCAB_SIZE
    if data.tokenizer_type in (None, "NullTokenizer"):
        return data.vocab_size or GPTConfig.vocab_size
    return GPTConfig.vocab_size  # the tokenizer's own, once loaded


def ignored_vocab_size(data: DataConfig) -> str | None:
    """The line that says --vocab-size is ignored: only NullTokenizer takes it, the others have
    their own vocabulary (Megatron-LM ignores it the same way); None when nothing is ignored."""
    if data.vocab_size is None or data.tokenizer_type in (None, "NullTokenizer"):
        return None
    return (
        f" megadyn: --vocab-size {data.vocab_size} is ignored: --tokenizer-type "
        f"{data.tokenizer_type} has its own vocabulary, which the model uses (as in Megatron-LM, "
        "only NullTokenizer takes --vocab-size)"
    )


def dump_args(cfg: MegadynConfig) -> dict[str, Any]:
    """The whole config as one flat dict of plain values ("section.field": value), for W&B's
    run config and for checkpoints."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, obj: Any) -> None:
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                walk(f"{prefix}.{f.name}" if prefix else f.name, getattr(obj, f.name))
        elif isinstance(obj, tuple):
            flat[prefix] = list(obj)
        elif isinstance(obj, torch.dtype):
            flat[prefix] = str(obj).removeprefix("torch.")
        else:
            flat[prefix] = obj

    walk("", cfg)
    return flat
