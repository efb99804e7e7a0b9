"""Checks of a whole `MegadynConfig` before a job starts: what cannot run is a `ConfigError`
whose message starts with the flag to change.

    cfg = parse_config(argv, world_size)     # arguments.py: flags -> config
    validate(cfg, world_size)                # raises ConfigError("--flag ...")

`arguments.parse_args` runs both; code that builds a config without a command line (tests, the
default job, the elastic planner) calls `validate` itself.
"""

from __future__ import annotations

from megadyn.core.layout import Layout
from megadyn.core.pipeline.cuda_graph import MicroBatchGraph, check_cuda_graph
from megadyn.data import TOKENIZER_TYPES, parse_data_path, parse_split
from megadyn.elastic.planning.requests import context_parallel_conflicts, validate_for
from megadyn.training.config import ConfigError, ElasticConfig, MegadynConfig
from megadyn.training.microbatches import MicroBatchCalculator
from megadyn.training.scheduler import check_schedule
from megadyn.training.straggler_log import check_straggler_flags

__all__ = ["validate"]


def validate(cfg: MegadynConfig, world_size: int) -> None:
    """Raise ConfigError, led by the flag to change, for anything in `cfg` that cannot run."""
    _validate_members(cfg.elastic, world_size)
    layout = _first_layout(cfg, world_size)
    _validate_context_parallel(cfg, layout)
    _validate_document_masking(cfg)
    check_variable_lengths(cfg, layout)
    _validate_recompute(cfg, layout)
    _validate_kernels(cfg, layout)
    check_schedule(cfg.scheduler, cfg.optimizer, cfg.training.train_iters)
    _validate_data(cfg)
    _validate_checkpoint(cfg)
    _validate_timeouts(cfg)
    check_straggler_flags(cfg)
    if cfg.logging.log_interval < 1:
        raise ConfigError(f"--log-interval must be >= 1, got {cfg.logging.log_interval}")


def _first_layout(cfg: MegadynConfig, world_size: int) -> Layout:
    """The first grid, checked; under --heterogeneous-pipelines the first layout may be
    replicas (hetero_config.py): the rest checks their tp as a one-stage grid."""
    if cfg.parallel.heterogeneous_pipelines is None:
        return _validate_layout(cfg, world_size)
    from megadyn.training.hetero_config import check_heterogeneous  # it imports this package

    layout = check_heterogeneous(cfg, world_size)
    return _validate_layout(cfg, world_size) if isinstance(layout, Layout) else Layout(tp=layout.tp)


def _validate_members(el: ElasticConfig, world_size: int) -> None:
    members = el.members(world_size)
    if not 1 <= members <= world_size:
        raise ConfigError(
            f"--elastic-initial-members ({members}) must be between 1 and the world size "
            f"({world_size})"
        )
    if not 1 <= el.min_members <= members:
        raise ConfigError(
            f"--elastic-min-members ({el.min_members}) must be between 1 and the "
            f"initial members ({members})"
        )


def _validate_layout(cfg: MegadynConfig, world_size: int) -> Layout:
    """The first layout, checked against the model, the optimizer and the batch sizes."""
    model, par = cfg.model, cfg.parallel
    per_stage = model.num_layers // par.pp
    nlpvps = par.num_layers_per_virtual_pipeline_stage
    if nlpvps is not None and (nlpvps < 1 or per_stage % nlpvps):
        raise ConfigError(
            f"--num-layers-per-virtual-pipeline-stage ({nlpvps}) must divide the layers per "
            f"pipeline stage (--num-layers {model.num_layers} / "
            f"--pipeline-model-parallel-size {par.pp} = {per_stage})"
        )
    try:
        layout = cfg.layout(world_size)
        validate_for(layout, model, cfg)
    except ValueError as err:  # LayoutError
        raise ConfigError.from_error(err) from err
    dist_opt = cfg.optimizer.use_distributed_optimizer
    if par.overlap_param_gather and not (dist_opt and par.overlap_grad_reduce):
        raise ConfigError(
            "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"
        )
    _validate_distopt_instances(par.num_distributed_optimizer_instances, dist_opt, layout)
    validate_sharding_strategy(cfg, layout)
    MicroBatchCalculator.from_config(cfg.training).check_dp_size(layout.dp)
    return layout


def _validate_distopt_instances(instances: int, dist_opt: bool, layout: Layout) -> None:
    """At the start the instances must divide dp x cp (a live change falls back to one)."""
    flag = "--num-distributed-optimizer-instances"
    if instances < 1:
        raise ConfigError(f"{flag} must be a positive integer, got {instances}")
    if instances > 1 and not dist_opt:
        raise ConfigError(f"{flag} ({instances}) needs --use-distributed-optimizer")
    if layout.distopt_instances != instances:
        with_cp = f" x --context-parallel-size ({layout.cp})" if layout.cp > 1 else ""
        raise ConfigError(
            f"{flag} ({instances}) must divide the data-parallel size ({layout.dp}){with_cp}: "
            "change it or the number of processes (world size / (--tensor-model-parallel-size "
            "x --pipeline-model-parallel-size))"
        )


def validate_sharding_strategy(cfg: MegadynConfig, layout: Layout) -> None:
    """--data-parallel-sharding-strategy optim_grads: what its first version runs with (also
    tools/bench_gpt.py's check)."""
    if cfg.parallel.data_parallel_sharding_strategy != "optim_grads":
        return
    flag = "--data-parallel-sharding-strategy optim_grads"
    if not cfg.optimizer.use_distributed_optimizer:
        raise ConfigError(f"{flag} needs --use-distributed-optimizer")
    if not cfg.parallel.overlap_grad_reduce:  # else a buffer is one bucket, staged whole
        raise ConfigError(
            f"{flag} needs --overlap-grad-reduce: without it each micro batch's gradients are "
            "staged whole until its backward ends, more memory than the default strategy"
        )
    unsupported = {
        "--pipeline-model-parallel-size > 1": layout.pp > 1,
        "--num-distributed-optimizer-instances > 1": layout.distopt_instances > 1,
        "--heterogeneous-pipelines": cfg.parallel.heterogeneous_pipelines is not None,
        "--dynamic-parallelism": cfg.training.dynamic_parallelism,
        "live reconfiguration (--elastic-control-port, --elastic-initial-members)": (
            cfg.elastic.live
        ),
    }
    for other, used in unsupported.items():
        if used:
            raise ConfigError(f"{flag} does not run with {other} yet: drop one of them")


def _validate_context_parallel(cfg: MegadynConfig, layout: Layout) -> None:
    """What context parallelism does not run with yet is refused, naming both flags (the
    sequence length is checked by `Layout.validate`)."""
    if layout.cp == 1:
        if cfg.model.cp_comm_type != "p2p":
            raise ConfigError("--cp-comm-type applies to --context-parallel-size > 1")
        if cfg.model.cp_placement != "static":
            raise ConfigError(
                f"--cp-placement {cfg.model.cp_placement} applies to --context-parallel-size > 1"
            )
        return
    _validate_dynamic_placement(cfg, layout)
    if cfg.model.cp_comm_type == "a2a" and cfg.model.attention_dropout > 0:
        raise ConfigError("--cp-comm-type a2a needs --attention-dropout 0")
    for other in context_parallel_conflicts(cfg):
        raise ConfigError(
            f"--context-parallel-size > 1 does not run with {other} yet: drop one of them"
        )


def _validate_dynamic_placement(cfg: MegadynConfig, layout: Layout) -> None:
    """--cp-placement dynamic (and static_blocks): whole blocks per rank, its own exchange,
    no attention dropout."""
    m = cfg.model
    if m.cp_placement == "static":
        return
    block, seq = m.cp_block_size, cfg.data.seq_length
    tp = layout.tp if layout.sequence_parallel else 1
    chunks = layout.cp * (1 if m.cp_placement == "dynamic" else 2)
    if block < 1 or seq % (block * chunks) or block % tp:
        raise ConfigError(
            f"--cp-block-size ({block}) x {chunks} must divide --seq-length ({seq}), and be a "
            "multiple of --tensor-model-parallel-size under --sequence-parallel, with "
            f"--cp-placement {m.cp_placement} and --context-parallel-size {layout.cp}"
        )
    if m.cp_comm_type != "p2p":
        raise ConfigError(
            f"--cp-comm-type {m.cp_comm_type} does not run with --cp-placement {m.cp_placement} "
            "(which sends each rank the key/value blocks it reads): drop one of them"
        )
    if m.attention_dropout > 0:
        raise ConfigError(f"--cp-placement {m.cp_placement} needs --attention-dropout 0")


def _validate_document_masking(cfg: MegadynConfig) -> None:
    """What --reset-attention-mask's attention does not run with yet, naming both flags."""
    if not cfg.data.reset_attention_mask:
        return
    unsupported = {
        "--attention-dropout > 0": cfg.model.attention_dropout > 0,
        "--enable-cuda-graph": cfg.training.enable_cuda_graph,
    }
    for other, used in unsupported.items():
        if used:
            raise ConfigError(
                f"--reset-attention-mask does not run with {other} yet: drop one of them"
            )


def check_variable_lengths(cfg: MegadynConfig, layout: Layout) -> None:
    """--sample-per-document and --micro-batch-tokens go together, and not (yet) with what
    needs one sample shape for every micro batch; the trainer checks each new layout too."""
    per_doc, budget = cfg.data.sample_per_document, cfg.training.micro_batch_tokens
    _check_dynamic_parallelism(cfg, layout)
    if per_doc != (budget is not None):
        raise ConfigError(
            "--sample-per-document and --micro-batch-tokens go together: give both or neither"
        )
    if not per_doc:
        return
    if budget < cfg.data.seq_length:
        raise ConfigError(
            f"--micro-batch-tokens ({budget}) must be at least --seq-length "
            f"({cfg.data.seq_length}), the longest sample"
        )
    try:
        blend = cfg.data.data_path is not None and len(parse_data_path(cfg.data.data_path)[0]) > 1
    except ValueError:  # a malformed --data-path: _validate_data names it
        blend = False
    unsupported = {
        "a blend of --data-path prefixes": blend,
        "--pipeline-model-parallel-size > 1": layout.pp > 1,
        "--context-parallel-size > 1": layout.cp > 1,
        "--enable-cuda-graph": cfg.training.enable_cuda_graph,
        "--mock-data": cfg.data.mock_data,
    }
    for other, used in unsupported.items():
        if used:
            raise ConfigError(
                f"--sample-per-document does not run with {other} yet: drop one of them"
            )


def _check_dynamic_parallelism(cfg: MegadynConfig, layout: Layout) -> None:
    """--dynamic-parallelism needs variable-length samples and a job that keeps its processes."""
    if not cfg.training.dynamic_parallelism:
        return
    if not cfg.data.sample_per_document:
        raise ConfigError(
            "--dynamic-parallelism groups samples by length: it needs --sample-per-document "
            "and --micro-batch-tokens"
        )
    unsupported = {
        "live reconfiguration (--elastic-control-port, --elastic-initial-members)": (
            cfg.elastic.live
        ),
        "--overlap-param-gather": cfg.parallel.overlap_param_gather,
        "--sequence-parallel": layout.sequence_parallel,
    }
    for other, used in unsupported.items():
        if used:
            raise ConfigError(
                f"--dynamic-parallelism does not run with {other} yet: drop one of them"
            )


def _validate_recompute(cfg: MegadynConfig, layout: Layout) -> None:
    rc = cfg.training.recompute
    chunk_layers = cfg.model.num_layers // (layout.pp * layout.vpp)
    if rc.granularity == "selective" and rc.num_layers is not None:
        raise ConfigError("--recompute-num-layers is only used with --recompute-granularity full")
    if rc.granularity == "full" and rc.num_layers > chunk_layers:
        raise ConfigError(
            f"--recompute-num-layers ({rc.num_layers}) exceeds the layers of one pipeline "
            f"chunk ({chunk_layers})"
        )


def _validate_kernels(cfg: MegadynConfig, layout: Layout) -> None:
    """--tp-comm-overlap and its transport, --fp8-format, --enable-cuda-graph."""
    model, train = cfg.model, cfg.training
    if model.tp_comm_overlap and not cfg.parallel.sequence_parallel:
        raise ConfigError(
            "--tp-comm-overlap overlaps sequence parallelism's collectives: it "
            "needs --sequence-parallel"
        )
    if model.fp8 is not None and model.tp_comm_overlap:
        raise ConfigError("--fp8-format does not run with --tp-comm-overlap yet: drop one of them")
    if model.tp_comm_overlap_transport != "nccl" and not model.tp_comm_overlap:
        raise ConfigError("--tp-comm-overlap-transport applies to --tp-comm-overlap: add it")
    if train.enable_cuda_graph:
        try:
            check_cuda_graph(
                pp=layout.pp,
                vpp=layout.vpp,
                dropout=max(model.hidden_dropout, model.attention_dropout),
                recompute=train.recompute.granularity,
                device=None,
            )
            MicroBatchGraph(train.cuda_graph_warmup_steps)
        except ValueError as err:
            raise ConfigError.from_error(err) from err


def _validate_data(cfg: MegadynConfig) -> None:
    data = cfg.data
    if data.mock_data and data.data_path is not None:
        raise ConfigError("--data-path and --mock-data are exclusive")
    if not data.mock_data and data.data_path is None:
        raise ConfigError("--data-path is required (or --mock-data)")
    try:
        if data.data_path is not None:
            parse_data_path(data.data_path)
        parse_split(data.split)
    except ValueError as err:
        raise ConfigError.from_error(err) from err
    if cfg.model.max_position_embeddings < data.seq_length:
        raise ConfigError(
            f"--max-position-embeddings ({cfg.model.max_position_embeddings}) must be at least "
            f"--seq-length ({data.seq_length})"
        )
    if data.tokenizer_type is None:
        raise ConfigError(f"--tokenizer-type is required: one of {', '.join(TOKENIZER_TYPES)}")
    needs = {
        "NullTokenizer": {"--vocab-size": data.vocab_size},
        "GPT2BPETokenizer": {"--vocab-file": data.vocab_file, "--merge-file": data.merge_file},
    }.get(data.tokenizer_type, {"--tokenizer-model": data.tokenizer_model})
    for flag, value in needs.items():
        if value is None:
            raise ConfigError(f"{flag} is required with --tokenizer-type {data.tokenizer_type}")


def _validate_checkpoint(cfg: MegadynConfig) -> None:
    """--save, --ckpt-keep-last, and which schedule goes on when a checkpoint is loaded."""
    ckpt = cfg.checkpoint
    if ckpt.save is not None and not (ckpt.save_interval and ckpt.save_interval > 0):
        raise ConfigError("--save-interval (> 0) is required with --save")
    if ckpt.keep_last is not None and ckpt.keep_last < 1:
        raise ConfigError(f"--ckpt-keep-last must be >= 1, got {ckpt.keep_last}")
    sched = cfg.scheduler
    if sched.override_opt_param_scheduler and sched.use_checkpoint_opt_param_scheduler:
        raise ConfigError(
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are "
            "exclusive: the first goes on with the command line's schedule, the second with "
            "the checkpoint's"
        )


def _validate_timeouts(cfg: MegadynConfig) -> None:
    par, el = cfg.parallel, cfg.elastic
    if par.distributed_timeout_minutes < 1:
        raise ConfigError(
            f"--distributed-timeout-minutes must be >= 1, got {par.distributed_timeout_minutes}"
        )
    if el.heartbeat_timeout < 0:
        raise ConfigError(
            f"--elastic-heartbeat-timeout must be >= 0 (0 = off), got {el.heartbeat_timeout}"
        )
