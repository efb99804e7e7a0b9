"""Process groups of one layout, as an object: built, passed around, destroyed.

    groups = ParallelGroups.build(layout, members=range(world), backend="gloo")
    model = GPTModel(cfg, groups)        # layers take the groups they use
    ...
    groups.destroy()                     # reconfiguration: drop it, build another

Context parallelism (cp > 1) adds a cp group (the ranks that split one sequence) and a dp x cp
group (the ranks that hold the same weights: gradient reduction and the distributed optimizer's
shards). With cp = 1 neither is created: `cp_group` is None and `dp_cp_group` is `dp_group`, so
a layout without cp creates exactly the groups it always did.

With `layout.distopt_instances` N > 1 (--num-distributed-optimizer-instances) two more kinds
come last: the intra-instance groups (dp x cp / N consecutive ranks that shard one copy of the
optimizer) and the inter-instance groups (the N ranks holding the same shard). With N = 1
neither is created: `intra_distopt_group` is `dp_cp_group` and `inter_distopt_group` is None.

Processes that are not members of the layout (standby processes) get an object with
`is_member == False` and no groups.

Every live process of the job calls `build` for every layout, in the same order, members or
not: each `new_group` call then draws the same sequential group name in every process, and a
name is never reused after `destroy()`. (Hashed names, which
`use_local_synchronization=True` gives, repeat when the same ranks form a group again, and a
group rebuilt under a repeated name can meet the old group's rendezvous keys in the store and
hang; megadyn's tests showed it.) Creating a group costs only its members communication;
non-members return at once, and processes that have left the job take no part.

What the layout's communication keeps between calls (--tp-comm-overlap's side stream and
symmetric-memory workspace) lives in `groups.comm` and goes with `destroy()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from megadyn.core import c10d_compat
from megadyn.core.comm_resources import CommOverlap, CommResources
from megadyn.core.layout import Coords, Layout, LayoutError, RankGrid, canonical_members


def _new_group(ranks: list[int], backend: str, timeout: timedelta | None):
    return dist.new_group(ranks, backend=backend, timeout=timeout)


@dataclass
class ParallelGroups:
    """The groups and coordinates of this rank in one layout."""

    layout: Layout
    grid: RankGrid
    rank: int
    backend: str
    coords: Coords | None
    tp_group: object = None
    dp_group: object = None
    pp_group: object = None
    mp_group: object = None
    embedding_group: object = None
    cp_group: object = None
    """The ranks that split each sequence (None with cp = 1)."""
    dp_cp_group: object = None
    """dp x cp ranks holding the same weights: gradients reduce, ZeRO shards over it."""
    intra_distopt_group: object = None
    """The ranks of this rank's distributed-optimizer instance (`dp_cp_group` with N = 1)."""
    inter_distopt_group: object = None
    """The ranks holding the same optimizer shard in the other instances (None with N = 1)."""
    members_group: object = None
    """All members of the layout over gloo: checkpoints and other CPU-side collectives."""
    loop_group: object = None
    """All members over gloo, for the training loop's thread only (the straggler report):
    an asynchronous checkpoint may run collectives on `members_group` from its thread."""
    tp_ranks: list[int] = field(default_factory=list)
    dp_ranks: list[int] = field(default_factory=list)
    pp_ranks: list[int] = field(default_factory=list)
    embedding_ranks: list[int] = field(default_factory=list)
    cp_ranks: list[int] = field(default_factory=list)
    dp_cp_ranks: list[int] = field(default_factory=list)
    intra_distopt_ranks: list[int] = field(default_factory=list)
    inter_distopt_ranks: list[int] = field(default_factory=list)
    comm: CommResources = field(default_factory=CommResources)
    """Streams and workspaces of this layout's overlapped communication (comm_resources.py)."""
    _owned: list = field(default_factory=list)

    @classmethod
    def build(
        cls,
        layout: Layout,
        members: Sequence[int],
        backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> ParallelGroups:
        """Create the groups of `layout` over `members` (an ordered list of global ranks);
        `timeout` bounds every collective on them (torch's default for the backend if None)."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialized before building groups")
        members = tuple(int(m) for m in members)
        world = dist.get_world_size()
        bad = [m for m in members if not 0 <= m < world]
        if bad:
            raise LayoutError(f"member ranks {bad} are outside the world of {world} processes")
        grid = RankGrid(layout, members)
        if canonical_members(layout, members) != members:
            raise LayoutError(
                f"members {list(members)} must be ascending within each pipeline stage, as torch "
                f"numbers group ranks: use {list(canonical_members(layout, members))}"
            )
        backend = backend or dist.get_backend()
        rank = dist.get_rank()
        coords = grid.coords_of(rank) if rank in members else None
        pg = cls(layout, grid, rank, backend, coords=coords)
        kinds = [
            ("tp", grid.tp_groups()),
            ("dp", grid.dp_groups()),
            ("pp", grid.pp_groups()),
            ("mp", grid.mp_groups()),
            ("embedding", grid.embedding_groups()),
        ]
        if layout.cp > 1:  # after the others: cp = 1 layouts draw the same group names as ever
            kinds += [("cp", grid.cp_groups()), ("dp_cp", grid.dp_cp_groups())]
        if layout.distopt_instances > 1:  # last, for the same reason
            kinds += [
                ("intra_distopt", grid.intra_distopt_groups()),
                ("inter_distopt", grid.inter_distopt_groups()),
            ]
        for kind, all_groups in kinds:
            for ranks in all_groups:  # every process creates every group, in one order
                group = _new_group(ranks, backend, timeout)
                if rank in ranks:
                    pg._owned.append(group)
                    setattr(pg, f"{kind}_group", group)
                    if kind != "mp":
                        setattr(pg, f"{kind}_ranks", ranks)
        if layout.cp == 1 and pg.is_member:
            pg.dp_cp_group, pg.dp_cp_ranks = pg.dp_group, pg.dp_ranks
        if layout.distopt_instances == 1 and pg.is_member:
            pg.intra_distopt_group, pg.intra_distopt_ranks = pg.dp_cp_group, pg.dp_cp_ranks
        group = _new_group(list(members), "gloo", timeout)
        loop = _new_group(list(members), "gloo", timeout)
        if pg.is_member:
            pg._owned += [group, loop]
            pg.members_group, pg.loop_group = group, loop
            pg.comm.serve(pg.tp_group)  # for layers given --tp-comm-overlap's transport name
        return pg

    # --- coordinates -------------------------------------------------------------------------
    @property
    def is_member(self) -> bool:
        return self.coords is not None

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def cp_rank(self) -> int:
        return self.coords.cp

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    @property
    def dp_cp_size(self) -> int:
        return self.layout.dp * self.layout.cp

    @property
    def distopt_instances(self) -> int:
        return self.layout.distopt_instances

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.layout.pp - 1

    def pp_neighbor(self, offset: int) -> int:
        """Global rank of the pipeline rank `offset` stages away (wrapping around)."""
        return self.pp_ranks[(self.coords.pp + offset) % self.layout.pp]

    def connect(self, device) -> None:
        """A small all-reduce in each of this rank's device groups and one exchange with the
        neighbouring pipeline stages: NCCL sets up a communicator at its first use, so this
        takes that cost out of the first training step (run beside the model build)."""
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread
        for group in (
            self.tp_group,
            self.pp_group,
            self.dp_group,
            self.mp_group,
            self.embedding_group,
            self.cp_group,
            None if self.layout.cp == 1 else self.dp_cp_group,
            self.inter_distopt_group,
            None if self.distopt_instances == 1 else self.intra_distopt_group,
        ):
            if group is not None:
                dist.all_reduce(torch.zeros(1, device=device), group=group)
        if self.layout.pp > 1:
            out, into = torch.zeros(1, device=device), torch.empty(1, device=device)
            ops = [
                dist.P2POp(dist.isend, out, self.pp_neighbor(1), self.pp_group),
                dist.P2POp(dist.irecv, into, self.pp_neighbor(-1), self.pp_group),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def comm_overlap(self, transport: str | None) -> CommOverlap | None:
        """The layers' `comm_overlap` for --tp-comm-overlap's `transport` ('nccl' or
        'copy-engine'; None: no overlap), carrying this layout's communication resources."""
        return None if transport is None else CommOverlap(transport, self.comm)

    def set_timeout(self, timeout: timedelta) -> None:
        """Bound every later collective on these groups by `timeout` (they were built with a
        shorter one, which bounds only how long their creation waits for a peer)."""
        for group in self._owned:
            c10d_compat.set_group_timeout(group, timeout)

    def destroy(self) -> None:
        """Release every group this object created and its communication resources; the object
        must not be used afterwards."""
        self.comm.release()
        for group in reversed(self._owned):
            dist.destroy_process_group(group)
        self._owned.clear()
        self.tp_group = self.dp_group = self.pp_group = self.mp_group = None
        self.embedding_group = self.members_group = self.loop_group = None
        self.cp_group = self.dp_cp_group = None
        self.intra_distopt_group = self.inter_distopt_group = None
