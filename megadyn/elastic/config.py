"""What megadyn/elastic reads of the job's configuration, as types it imports.

    ElasticConfig(initial_members=2, control_port=29600)   # the --elastic-* flags
    def resolve_drain(rank, model_cfg: GPTConfig, cfg: JobConfig, ...)   # what elastic reads

`ElasticConfig` is the elastic section of the job's config (megadyn/training/config.py's
`MegadynConfig.elastic`, which the training package re-imports). The rest of the job's config
belongs to the training package above this one: `JobConfig` and its sections are Protocols
that declare the attributes elastic reads of it, and nothing more, so every read of a config
attribute under megadyn/elastic is declared on a type of this module or on `GPTConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

from megadyn.core.recompute import RecomputeConfig
from megadyn.models.config import GPTConfig


@dataclass(frozen=True)
class ElasticConfig:
    """How the job lives under torchrun (megadyn/launch) and changes its layout live
    (megadyn/elastic): members and standby processes, snapshots, heartbeats, restarts."""

    initial_members: int | None = None
    """Processes that train from the start; the rest of the launched world waits as standby
    (--elastic-initial-members); None = all."""
    min_members: int = 1
    """Fewest members to keep training with; below it the job saves a checkpoint and stops
    (--elastic-min-members)."""
    layout: str = "auto"
    """On a membership change, 'auto' lets the planner choose tp/pp/dp/vpp/micro batch/recompute;
    'pinned' keeps tp, pp and vpp and changes dp only (--elastic-layout)."""
    snapshot_interval: int = 0
    """Iterations between host-memory snapshots of the training state, replicated to a peer; 0 = off
    (--elastic-snapshot-interval)."""
    control_interval: int = 1
    """Iterations between checks for operator requests and membership changes
    (--elastic-control-interval)."""
    reshard_chunk_mb: int = 512
    """Largest transfer chunk while resharding, which bounds the extra memory per rank, in MiB
    (--elastic-reshard-chunk-mb)."""
    snapshot_dir: str = ""
    """Where in-memory snapshots go on each host (--elastic-snapshot-dir); default
    /dev/shm/megadyn-<torchrun run id>, host shared memory that outlives the workers.
    Environment variables in it are expanded on each host (e.g. /dev/shm/ckpt-$MEGADYN_HOST)."""
    control_port: int | None = None
    """Port of the control store that rank 0 hosts for tools/elastic_ctl.py; setting it (or
    --elastic-initial-members) turns live reconfiguration on (--elastic-control-port)."""
    heartbeat_timeout: float = 30.0
    """Under torchrun, seconds a rank may go without a heartbeat in the job's store before every
    other rank names it and exits, so that torchrun restarts the job instead of waiting in a
    collective; 0 = off (--elastic-heartbeat-timeout)."""
    fork_server: bool = True
    """Under torchrun with restarts allowed (--max-restarts > 0), keep one process per host
    with torch and megadyn imported, from which the workers of a restarted attempt fork
    instead of importing again (megadyn/launch/fork_server.py); --no-elastic-fork-server
    turns it off."""
    recovery: str = "in-process"
    """What a failure does in elastic mode: 'in-process' drains a worker that gets SIGTERM (a
    preemption notice) at the next step boundary as a live scale-in (a standby process takes
    its place when one waits) and it exits 0; under `python -m megadyn.launch` the survivors of
    a worker that dies or hangs recover in the same processes (megadyn/elastic/recovery/recovery.py).
    'restart' ends the worker, as without elastic mode, and torchrun restarts the job
    (--elastic-recovery)."""
    exit_signal_handler: bool = False
    """On SIGTERM that is not drained, save a checkpoint (with --save) at the next step boundary
    and exit 0, as Megatron-LM does; without it SIGTERM ends the process (--exit-signal-handler)."""
    straggler_policy: str = "log"
    """What a detected straggler (a rank whose compute time stays above --straggler-threshold x
    the median for --straggler-intervals log intervals) makes the job do: 'log' prints it;
    'exclude' (elastic mode) moves the job to the layout without it, as a drain of that rank
    does, and the rank waits as a standby process; 'rebalance' (with --heterogeneous-pipelines)
    gives its data-parallel replica fewer micro batches, the others more
    (--elastic-straggler-policy)."""

    @property
    def live(self) -> bool:
        """Live reconfiguration is on."""
        return self.control_port is not None or self.initial_members is not None

    def members(self, world_size: int) -> int:
        """Ranks the first layout is drawn over."""
        return self.initial_members or world_size


class ParallelView(Protocol):
    """What elastic reads of the parallel section (--tensor-model-parallel-size, ...)."""

    @property
    def tp(self) -> int: ...
    @property
    def heterogeneous_pipelines(self) -> tuple[int, ...] | None: ...
    @property
    def num_distributed_optimizer_instances(self) -> int: ...
    @property
    def overlap_grad_reduce(self) -> bool: ...
    @property
    def distributed_timeout(self) -> timedelta: ...


class TrainingView(Protocol):
    """What elastic reads of the training section (batch sizes, recomputation)."""

    @property
    def global_batch_size(self) -> int: ...
    @property
    def micro_batch_size(self) -> int: ...
    @property
    def recompute(self) -> RecomputeConfig: ...
    @property
    def enable_cuda_graph(self) -> bool: ...


class DataView(Protocol):
    """What elastic reads of the data section."""

    @property
    def seq_length(self) -> int: ...
    @property
    def sample_per_document(self) -> bool: ...


class OptimizerView(Protocol):
    """What elastic reads of the optimizer's config."""

    @property
    def use_distributed_optimizer(self) -> bool: ...


class CheckpointView(Protocol):
    """What elastic reads of the checkpoint section."""

    @property
    def save(self) -> str | None: ...


class JobConfig(Protocol):
    """The job's config as elastic reads it (megadyn/training/config.py's `MegadynConfig`)."""

    @property
    def model(self) -> GPTConfig: ...
    @property
    def elastic(self) -> ElasticConfig: ...
    @property
    def parallel(self) -> ParallelView: ...
    @property
    def training(self) -> TrainingView: ...
    @property
    def data(self) -> DataView: ...
    @property
    def optimizer(self) -> OptimizerView: ...
    @property
    def checkpoint(self) -> CheckpointView: ...
