"""Process groups of a heterogeneous layout, and the gradient sums across its replicas.

    hetero = HeteroGroups.build(layout, backend="gloo")     # layout: a HeteroLayout
    parts = build_model_parts(cfg, model_cfg, hetero, device)   # the replica's stage, DDP
    forward_backward(parts.ddp, hetero.replica, batches, hetero.micro_batches, ...,
                     loss_scale=hetero.batch_share)
    reduce_hetero_grads(parts.ddp, hetero)                   # then optimizer.step()
    hetero.destroy()

Each replica is one pipeline: its groups are those of the grid (tp, pp = its stages, dp 1)
over its members (`ParallelGroups`), so the schedules, the p2p communication and tensor
parallelism run on it unchanged. What differs is the data-parallel reduction: a replica runs
`micro_batches` of the step's micro batches and back-propagates its losses divided by the whole
step's count (its `batch_share` of the mean), and each weight's gradient is then summed over
the ranks that hold it in every replica (`HeteroLayout.reduce_groups`: one group per layer
range and tp rank, and the embedding ends), which replaces both the dp reduction and the
tied-embedding sum of a grid. The DDP wrappers do that sum (`grad_group_of` gives each
parameter's group: one gradient buffer per group); with the distributed optimizer they
reduce-scatter instead, so each rank keeps the fp32 main weights and Adam moments of its part
of every group's buffer, and all-gather the updated weights over the same group.

Gradient statistics (norm, overflow): without the distributed optimizer every replica holds
the whole summed gradient and reduces over its own model-parallel group; with it each element
is owned by one rank of the job, and `stats_group` (every member) sums them.

Every live process builds every group in one order (members or not), as `ParallelGroups.build`
asks: first each replica's groups, then the reduce groups, then the members' groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist
from torch import nn

from megadyn.core import c10d_compat
from megadyn.core.groups import ParallelGroups
from megadyn.core.hetero_layout import HeteroCoords, HeteroLayout, reduce_part


class MemberList(NamedTuple):
    """The layout's members in order (a grid's `RankGrid.members`)."""

    members: tuple[int, ...]


@dataclass
class HeteroGroups:
    """This rank's replica groups and its gradient-reduction groups in a heterogeneous layout."""

    layout: HeteroLayout
    rank: int
    coords: HeteroCoords | None
    replica: ParallelGroups | None
    """This rank's pipeline as a (tp, pp, dp 1) grid; None for a non-member."""
    reduce: dict = field(default_factory=dict)
    """Reduce part (a layer range or an embedding end's name) -> process group, for the parts
    this rank holds; parts held by the same ranks share one group (and one all-reduce)."""
    members_group: object = None
    """All members of the layout over gloo: checkpoints and other CPU-side collectives."""
    stats_group: object = None
    """All members over the job's backend: gradient statistics under the distributed
    optimizer (each gradient element is owned by one member). Not `members_group`, on which
    an asynchronous checkpoint may run collectives from its thread meanwhile."""
    loop_group: object = None
    """All members over gloo, for the training loop's thread only (the straggler report)."""
    backend: str = ""
    _replicas: list[ParallelGroups] = field(default_factory=list)
    _owned: list = field(default_factory=list)

    @classmethod
    def build(
        cls, layout: HeteroLayout, backend: str | None = None, timeout: timedelta | None = None
    ) -> HeteroGroups:
        backend = backend or dist.get_backend()
        rank = dist.get_rank()
        coords = layout.coords_of(rank) if rank in layout.members else None
        replicas = [
            ParallelGroups.build(layout.replica_layout(i), rep.members, backend, timeout)
            for i, rep in enumerate(layout.replicas)
        ]
        out = cls(layout, rank, coords, replicas[coords.replica] if coords else None)
        out._replicas, out.backend = replicas, backend
        by_ranks: dict[tuple[int, ...], object] = {}  # parts held by the same ranks share one
        for group in layout.reduce_groups():
            if group.ranks not in by_ranks:
                pg = dist.new_group(list(group.ranks), backend=backend, timeout=timeout)
                by_ranks[group.ranks] = pg
                if rank in group.ranks:
                    out._owned.append(pg)
            if rank in group.ranks:
                out.reduce[group.part] = by_ranks[group.ranks]
        members = dist.new_group(list(layout.members), backend="gloo", timeout=timeout)
        # a group of its own: checkpoints run on `members` in a background thread
        stats = dist.new_group(list(layout.members), backend=backend, timeout=timeout)
        loop = dist.new_group(list(layout.members), backend="gloo", timeout=timeout)
        if coords is not None:
            out.members_group, out.stats_group, out.loop_group = members, stats, loop
            out._owned += [members, stats, loop]
        return out

    @property
    def is_member(self) -> bool:
        return self.coords is not None

    # --- the job's view: what a trainer, checkpoints and the controller read of a layout's
    # groups (as of `ParallelGroups`); a replica is a data-parallel rank of the job
    @property
    def grid(self) -> MemberList:
        return MemberList(self.layout.members)

    @property
    def dp_rank(self) -> int:
        return self.coords.replica

    @property
    def dp_size(self) -> int:
        return len(self.layout.replicas)

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def pp_rank(self) -> int:
        return self.coords.stage

    @property
    def cp_rank(self) -> int:
        return 0

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def tp_group(self):
        return self.replica.tp_group

    @property
    def tp_ranks(self) -> list[int]:
        return self.replica.tp_ranks

    @property
    def cp_group(self):
        return None

    @property
    def is_first_stage(self) -> bool:
        return self.replica.is_first_stage

    @property
    def is_last_stage(self) -> bool:
        return self.replica.is_last_stage

    @property
    def loss_group(self):
        """The last stages of every replica at this rank's tp rank (the final norm's reduce
        group): where the step's losses are summed."""
        return self.reduce["final_layernorm"]

    def connect(self, device) -> None:
        self.replica.connect(device)

    def grad_group_of(self, name: str):
        """The group the gradient of this rank's parameter `name` (its global name) is
        summed over: the ranks holding its layer range (or embedding end) in every replica."""
        return self.reduce[reduce_part(name, self.layout.layer_ranges())]

    @property
    def stage_layers(self) -> tuple[range, ...]:
        """Layers of each stage of this rank's replica."""
        return self.layout.replicas[self.coords.replica].stage_layers

    @property
    def micro_batches(self) -> int:
        """Micro batches this rank's replica runs per step."""
        return self.layout.replicas[self.coords.replica].micro_batches

    @property
    def microbatch_offset(self) -> int:
        """Index of the replica's first micro batch among the step's."""
        return self.layout.microbatch_offset(self.coords.replica)

    @property
    def batch_share(self) -> float:
        """The replica's micro batches over the step's: the schedule's losses, divided by the
        replica's count, times this, are each micro batch's share of the step's mean."""
        return self.micro_batches / self.layout.num_microbatches

    def set_timeout(self, timeout) -> None:
        """Bound every later collective on these groups, the replicas' own too, by `timeout`
        (see ParallelGroups.set_timeout)."""
        for group in self._owned:
            c10d_compat.set_group_timeout(group, timeout)
        for replica in self._replicas:
            replica.set_timeout(timeout)

    def destroy(self) -> None:
        for group in reversed(self._owned):
            dist.destroy_process_group(group)
        self._owned.clear()
        self.reduce.clear()
        self.members_group = self.stats_group = self.loop_group = None
        for replica in self._replicas:
            replica.destroy()
        self._replicas.clear()
        self.replica = None


def reduce_hetero_grads(chunks: Sequence[nn.Module], hetero: HeteroGroups) -> None:
    """Make every gradient final for the optimizer step: finish the DDP wrappers' sums over
    each layer range's reduce group (with the distributed optimizer a reduce-scatter: only
    this rank's part of each buffer is final). Replicas run without sequence parallelism
    (training/hetero_config.py refuses it), so no gradient waits for a sum over tp first."""
    for chunk in chunks:
        chunk.finish_grad_sync()
