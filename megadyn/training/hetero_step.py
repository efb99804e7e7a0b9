"""What a training step does differently on replicas of different pipeline depth.

    step = HeteroStep.of(groups, cfg)        # None on a grid (ParallelGroups)
    loader = step.loader(dataset, cfg, consumed, documents)   # this replica's share of a step
    forward_backward(ddp, step.replica, loader, step.micro_batches, ...,
                     loss_scale=step.loss_scale(optimizer.loss_scale))
    step.finish_grads(ddp)                   # sums over every replica: then optimizer.step()
    step.mean_loss(losses)                   # the global batch's mean (last stages)

A step of a heterogeneous layout (megadyn/core/hetero_layout.py) runs the global batch's micro
batches in consecutive blocks: replica i runs micro batches offset_i .. offset_i + count_i - 1 of
the step, that is global samples consumed + (offset_i + j) * mbs + k. Each replica therefore
reads its share of the step exactly once through one dp-1 `MicroBatchLoader` (the usual data
cursor), and `ReplicaLoader` moves that cursor from step to step. Each replica back-propagates
its micro batches' losses divided by the whole step's count, so the gradients summed over the
replicas (`reduce_hetero_grads`) and the logged loss are the global batch's mean, the number a
grid gives.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from megadyn.core.hetero_groups import HeteroGroups, reduce_hetero_grads
from megadyn.data.sampler import DataCursor
from megadyn.training.config import ConfigError, MegadynConfig
from megadyn.training.data_setup import build_loader


class ReplicaLoader(DataCursor):
    """One replica's micro batches: per step at cursor c, those at c + (offset + j) * mbs for
    j < count; then the cursor moves to c + global batch (what the other replicas read)."""

    def __init__(self, inner, micro_batch_size: int, global_batch: int, offset: int, count: int):
        self.inner, self.mbs, self.global_batch = inner, micro_batch_size, global_batch
        self.offset, self.count = offset, count
        self._consumed, self._taken = inner.consumed_samples, 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._taken == 0:  # a new step: this replica's first micro batch
            self.inner.consumed_samples = self._consumed + self.offset * self.mbs
        batch = next(self.inner)
        self._taken += 1
        if self._taken == self.count:  # the step is read: past the other replicas' shares
            self._taken = 0
            self._consumed += self.global_batch
        return batch

    def _cursor_moved(self) -> None:
        self._taken = 0

    def samples(self, consumed: int) -> range:
        """Global sample indices this replica reads in the step at cursor `consumed`."""
        start = consumed + self.offset * self.mbs
        return range(start, start + self.count * self.mbs)


class HeteroStep:
    """This rank's replica in a heterogeneous layout, as one training step uses it."""

    def __init__(self, groups: HeteroGroups, cfg: MegadynConfig):
        self.groups = groups
        self.mbs = cfg.training.micro_batch_size
        self.global_batch = cfg.training.global_batch_size
        total = groups.layout.num_microbatches * self.mbs
        if total != self.global_batch:
            raise ConfigError(
                f"the replicas' micro batches ({groups.layout.num_microbatches} x "
                f"--micro-batch-size {self.mbs}) must make --global-batch-size "
                f"({self.global_batch})"
            )

    @staticmethod
    def of(groups, cfg: MegadynConfig) -> HeteroStep | None:
        return HeteroStep(groups, cfg) if isinstance(groups, HeteroGroups) else None

    @property
    def replica(self):
        """The replica's groups: a (tp, pp = its stages, dp 1) grid's."""
        return self.groups.replica

    @property
    def micro_batches(self) -> int:
        return self.groups.micro_batches

    def loader(self, dataset, cfg: MegadynConfig, consumed: int, documents) -> ReplicaLoader:
        inner = build_loader(dataset, cfg, 0, 1, consumed, documents)
        g = self.groups
        return ReplicaLoader(
            inner, self.mbs, self.global_batch, g.microbatch_offset, g.micro_batches
        )

    def loss_scale(self, scale: float) -> float:
        """The schedule divides each loss by the replica's count: times its share of the step."""
        return scale * self.groups.batch_share

    def finish_grads(self, ddp) -> None:
        reduce_hetero_grads(ddp, self.groups)

    def mean_loss(self, losses) -> torch.Tensor:
        """The mean over the global batch's micro batches (on last stages)."""
        loss = torch.stack([x.detach().float() for x in losses]).sum()
        dist.all_reduce(loss, group=self.groups.loss_group)
        return loss / self.groups.layout.num_microbatches
