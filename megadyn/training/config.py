"""The job's configuration: one frozen dataclass per component, one docstring per field.

`arguments.parse_args` translates the command line into a `MegadynConfig`; code that builds a
job without a command line (tests, the default job, the elastic planner) builds these directly
and checks them with `arguments.validate`:

    cfg = MegadynConfig(model=GPTConfig.gpt2(...), optimizer=OptimizerConfig(lr=3e-4),
                        training=TrainingConfig(micro_batch_size=2, global_batch_size=16,
                                                train_iters=100))
    validate(cfg, world_size=8)         # arguments.validate: ConfigError("--flag ...")

Field docstrings are also the `--help` text of the flags (see `field_docs`).
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from dataclasses import dataclass, field
from datetime import timedelta

from megadyn.core.layout import Layout
from megadyn.core.optimizer import OptimizerConfig
from megadyn.core.recompute import RecomputeConfig
from megadyn.elastic.config import ElasticConfig
from megadyn.models.config import GPTConfig

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


class ConfigError(ValueError):
    """A configuration that cannot run; the message starts with the flag to change."""

    @classmethod
    def from_error(cls, err: Exception) -> ConfigError:
        """Re-raise a ValueError of another module (LayoutError, GPTConfig) led by its first flag."""
        msg = str(err)
        flag = re.search(r"--[a-z0-9][a-z0-9-]*", msg)
        if flag is None or msg.startswith(flag.group()):
            return cls(msg)
        return cls(f"{flag.group()}: {msg}")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, whitespace folded (used as --help)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size (--tensor-model-parallel-size)."""
    pp: int = 1
    """Pipeline-parallel size (--pipeline-model-parallel-size)."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers per virtual pipeline stage, for the interleaved schedule
    (--num-layers-per-virtual-pipeline-stage); None = no interleaving."""
    sequence_parallel: bool = False
    """Shard activations outside tensor-parallel regions along the sequence; needs tp > 1
    (--sequence-parallel)."""
    cp: int = 1
    """Context-parallel size: ranks that split each sequence, two load-balanced chunks each
    (--context-parallel-size)."""
    scatter_gather_tensors_in_pipeline: bool = True
    """Send 1/tp of each activation between pipeline stages and all-gather it after (off:
    --no-scatter-gather-tensors-in-pipeline)."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the backward pass (--overlap-grad-reduce)."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the next forward
    (--overlap-param-gather)."""
    num_distributed_optimizer_instances: int = 1
    """Copies of the distributed optimizer's state (--num-distributed-optimizer-instances): the
    data-parallel ranks form this many instances, each sharding the state over its own ranks,
    so each shard is also held by a rank of every other instance. A layout whose dp x cp it
    does not divide (after a live change) runs with one instance and says so."""
    data_parallel_sharding_strategy: str = "optim"
    """What the distributed optimizer shards over data parallelism
    (--data-parallel-sharding-strategy): "optim" (ZeRO-1) the main params and Adam state,
    "optim_grads" (ZeRO-2) the gradients too: a rank keeps only its part of them between micro
    batches, reduce-scattering every micro batch (megadyn/core/distributed/sharded_grads.py)."""
    heterogeneous_pipelines: tuple[int, ...] | None = None
    """Data-parallel replicas of different pipeline depth, built from pipeline templates
    (--heterogeneous-pipelines [STAGES ...]): with stage counts (e.g. 3 2) the job starts as
    those replicas (tp x the sum of them processes); without, it starts on the command line's
    grid where that fits the members, else on the template planner's mix, and with
    --elastic-layout auto a change of members takes templates when they use more members than
    any grid and are modelled faster. None = off."""
    distributed_timeout_minutes: int = 10
    """Timeout of the default process group and of every group megadyn creates
    (--distributed-timeout-minutes)."""

    @property
    def distributed_timeout(self) -> timedelta:
        """--distributed-timeout-minutes as a timedelta, for process groups."""
        return timedelta(minutes=self.distributed_timeout_minutes)

    def virtual_stages(self, num_layers: int) -> int:
        """Virtual stages per pipeline rank (Megatron's vpp size); 1 = no interleaving."""
        if self.num_layers_per_virtual_pipeline_stage is None:
            return 1
        return max(1, num_layers // self.pp // self.num_layers_per_virtual_pipeline_stage)

    def layout(self, num_members: int, num_layers: int) -> Layout:
        """The layout with these degrees over `num_members` ranks (raises LayoutError)."""
        layout = Layout.from_world(
            num_members,
            self.tp,
            self.pp,
            self.virtual_stages(num_layers),
            self.sequence_parallel,
            cp=self.cp,
        )
        return layout.with_distopt_instances(self.num_distributed_optimizer_instances)


@dataclass(frozen=True)
class TrainingConfig:
    micro_batch_size: int = 1
    """Samples per micro batch on one data-parallel rank (--micro-batch-size)."""
    micro_batch_tokens: int | None = None
    """Micro batches of whole variable-length samples holding at most this many tokens,
    padding included, instead of --micro-batch-size samples; needs --sample-per-document
    (--micro-batch-tokens, megadyn's flag)."""
    dynamic_parallelism: bool = False
    """Hot switching: each step's samples are grouped by length, each group runs under its own
    layout over the same processes (weights moved in, gradients brought back to this layout's
    buffers), one optimizer step (--dynamic-parallelism; megadyn/training/hot_switch.py)."""
    dynamic_parallelism_memory_gib: float | None = None
    """GiB per device the length planner may plan for; default 90% of the device's memory
    (CUDA) or unbounded (CPU) (--dynamic-parallelism-memory-gib)."""
    global_batch_size: int = 1
    """Samples per optimizer step over all data-parallel ranks; stays fixed when dp changes
    (--global-batch-size)."""
    rampup_batch_size: tuple[int, int, int] | None = None
    """Start batch size, increment, ramp-up samples (--rampup-batch-size); needs --train-samples."""
    train_iters: int = 1
    """Optimizer steps to train for (--train-iters); derived from --train-samples when that is
    given."""
    train_samples: int | None = None
    """Samples to train on, instead of --train-iters (--train-samples)."""
    eval_interval: int = 1000
    """Iterations between evaluations on the validation split (--eval-interval)."""
    eval_iters: int = 100
    """Iterations of each evaluation (--eval-iters)."""
    exit_interval: int | None = None
    """Exit after an iteration divisible by this (--exit-interval)."""
    seed: int = 1234
    """Seed of initialization, dropout and data order (--seed)."""
    deterministic_mode: bool = False
    """Bit-equal losses run after run on the same GPUs: torch's deterministic algorithms (the
    attention backward without atomics), a fixed cuBLAS workspace, no NVLS in NCCL; slower
    (--deterministic-mode; megadyn/launch/determinism.py)."""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    """Activation recomputation (--recompute-granularity, --recompute-method,
    --recompute-num-layers)."""
    enable_cuda_graph: bool = False
    """Replay each micro batch's forward and backward from a CUDA graph captured after the
    warm-up steps; pp 1, no dropout, no recomputation (--enable-cuda-graph)."""
    cuda_graph_warmup_steps: int = 3
    """Eager steps before the CUDA graph is captured (--cuda-graph-warmup-steps)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """How lr and weight decay move; their values (--lr, --min-lr, --weight-decay) are in
    OptimizerConfig."""

    lr_decay_style: str = "linear"
    """constant, linear, cosine, inverse-square-root or WSD (--lr-decay-style)."""
    lr_decay_iters: int | None = None
    """Iterations to decay over, warmup included; None = --train-iters (--lr-decay-iters)."""
    lr_warmup_iters: int = 0
    """Iterations of linear warmup from --lr-warmup-init to --lr (--lr-warmup-iters)."""
    lr_warmup_fraction: float | None = None
    """Warmup as a fraction of the decay iterations, instead of --lr-warmup-iters
    (--lr-warmup-fraction)."""
    lr_warmup_init: float = 0.0
    """Learning rate at iteration 0 (--lr-warmup-init)."""
    lr_wsd_decay_iters: int | None = None
    """Iterations of the final annealing phase of the WSD schedule (--lr-wsd-decay-iters)."""
    lr_wsd_decay_style: str = "exponential"
    """Annealing shape of WSD: exponential, linear, cosine or minus_sqrt (--lr-wsd-decay-style)."""
    start_weight_decay: float | None = None
    """Weight decay at iteration 0; None = --weight-decay (--start-weight-decay)."""
    end_weight_decay: float | None = None
    """Weight decay at the last iteration; None = --weight-decay (--end-weight-decay)."""
    weight_decay_incr_style: str = "constant"
    """How weight decay moves from start to end over training: constant, linear or cosine
    (--weight-decay-incr-style)."""
    override_opt_param_scheduler: bool = False
    """On resume, go on with the command line's schedule values where the checkpoint's differ
    (without this or --use-checkpoint-opt_param-scheduler a difference is an error)
    (--override-opt_param-scheduler)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, go on with the checkpoint's schedule values where the command line's differ
    (--use-checkpoint-opt_param-scheduler)."""

    def warmup_iters(self, decay_iters: int) -> float:
        """Warmup length in iterations (a float with --lr-warmup-fraction, as in Megatron)."""
        if self.lr_warmup_fraction is not None:
            return self.lr_warmup_fraction * decay_iters
        return self.lr_warmup_iters


@dataclass(frozen=True)
class DataConfig:
    data_path: tuple[str, ...] | None = None
    """Dataset prefixes, each optionally preceded by its weight: 'p' or 'w1 p1 w2 p2' (--data-path)."""
    split: str = "969, 30, 1"
    """Train, validation, test proportions of --data-path (--split)."""
    seq_length: int = 128
    """Tokens per sample (--seq-length)."""
    tokenizer_type: str | None = None
    """One of megadyn.data.TOKENIZER_TYPES (--tokenizer-type)."""
    tokenizer_model: str | None = None
    """SentencePiece model file or Hugging Face tokenizer name/path (--tokenizer-model)."""
    vocab_file: str | None = None
    """GPT-2 BPE vocabulary json (--vocab-file)."""
    merge_file: str | None = None
    """GPT-2 BPE merges file (--merge-file)."""
    vocab_size: int | None = None
    """Vocabulary of the NullTokenizer, before its end-of-document token (--vocab-size)."""
    mock_data: bool = False
    """Train on synthetic tokens, a function of (seed, sample index); no --data-path (--mock-data)."""
    num_workers: int = 2
    """Data loader worker processes (--num-workers)."""
    data_cache_path: str | None = None
    """Directory for the cached sample indices (--data-cache-path)."""
    reset_attention_mask: bool = False
    """Attention stays within each document of a packed sample: a token sees the earlier
    tokens up to and including its document's end-of-document token only
    (--reset-attention-mask)."""
    sample_per_document: bool = False
    """A sample is one document cut at --seq-length + 1 tokens, not a packed fixed-length
    window; its micro batches are cut by --micro-batch-tokens (--sample-per-document,
    megadyn's flag)."""
    eod_mask_loss: bool = False
    """No loss at positions whose input token is the end-of-document token, i.e. on the
    prediction of the next document's first token; the loss is the mean over the other
    tokens (--eod-mask-loss)."""


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None
    """Directory to save checkpoints to (--save)."""
    load: str | None = None
    """Directory to load the latest checkpoint from (--load)."""
    save_interval: int | None = None
    """Iterations between checkpoints; required with --save (--save-interval)."""
    async_save: bool = False
    """Write checkpoints in the background while training goes on (--async-save)."""
    keep_last: int | None = None
    """Keep only this many newest checkpoints; None = keep all (--ckpt-keep-last, megadyn's flag)."""
    no_load_optim: bool = False
    """Load weights only, not the optimizer state (--no-load-optim)."""
    no_load_rng: bool = False
    """Do not restore the RNG states (--no-load-rng)."""
    finetune: bool = False
    """Load weights only and start at iteration 0 (--finetune)."""
    ckpt_step: int | None = None
    """Load the checkpoint of this iteration under --load instead of the one that
    latest_checkpointed_iteration.txt names; --load then holds its directory (--ckpt-step)."""


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 100
    """Iterations between log lines and W&B points (--log-interval)."""
    log_throughput: bool = False
    """Print TFLOP/s per GPU in the log line (--log-throughput)."""
    timing_log_level: int = 0
    """Accepted for Megatron compatibility: 0, 1 or 2 (--timing-log-level)."""
    wandb_project: str | None = None
    """W&B project; no W&B logging without it (--wandb-project)."""
    wandb_exp_name: str | None = None
    """W&B run name (--wandb-exp-name)."""
    wandb_save_dir: str | None = None
    """Local directory of W&B files; default <--save>/wandb (--wandb-save-dir)."""
    metrics_file: str | None = None
    """JSON-lines file the logging rank appends the iteration metrics and elastic events to,
    one record per --log-interval (tools/plot_run.py and tools/compare_losses.py read it);
    default <--save>/metrics.jsonl, none without --save (--metrics-file)."""
    log_straggler: bool = False
    """Every --log-interval, print one line naming the slowest rank by its compute time (forward
    and backward, waits for data excluded), its host and GPU, and its score against the median
    rank; the metrics file and W&B get every rank's figures (--log-straggler)."""
    straggler_threshold: float = 1.15
    """A rank whose compute time is above this multiple of the median rank's counts as slow in
    a log interval (--straggler-threshold)."""
    straggler_intervals: int = 3
    """Consecutive slow log intervals that make a rank a straggler (--straggler-intervals)."""


@dataclass(frozen=True)
class MegadynConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    """The network (model flags)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel degrees and process groups."""
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    """Live reconfiguration, snapshots, heartbeats and restarts (the --elastic-* flags)."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Batch sizes, length of training, recomputation."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Adam, mixed precision, ZeRO-1 (megadyn.core.optimizer's config)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate and weight-decay schedules."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and tokenizer."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and loading."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Log line and W&B."""

    def layout(self, world_size: int) -> Layout:
        """The first layout of the job, over its initial members."""
        members = self.elastic.members(world_size)
        return self.parallel.layout(members, self.model.num_layers)
