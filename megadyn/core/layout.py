"""The parallel layout and its rank arithmetic, pure Python and testable without processes.

A `Layout` says how many ways the model is split (tp, pp, virtual stages), how many ways each
sequence is split (cp, context parallelism) and how many times the model is replicated (dp).
Ranks are ordered the way Megatron orders them: tensor-parallel fastest, then context-parallel,
then data-parallel, then pipeline-parallel, over an ordered list of *member* ranks, so a layout
can be drawn over any subset of the running processes:

    position = tp_rank + cp_rank * tp + dp_rank * tp * cp + pp_rank * tp * cp * dp
    member   = members[position]

Weights are replicated over cp as over dp, so gradients reduce over the dp x cp ranks of a
(tp, pp) coordinate (`dp_cp_groups`). With cp = 1 every formula is the one without cp.

Every process group of megadyn is derived from `RankGrid.groups()`; nothing here touches
torch.distributed (see `groups.py` for that).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import NamedTuple


class LayoutError(ValueError):
    """A layout that cannot run; the message names the flag to change."""


class Coords(NamedTuple):
    """Where one rank sits in the grid."""

    tp: int
    dp: int
    pp: int
    cp: int = 0


@dataclass(frozen=True)
class Layout:
    """Parallel degrees of one configuration of the job."""

    tp: int = 1
    """Tensor-parallel size (--tensor-model-parallel-size)."""
    pp: int = 1
    """Pipeline-parallel size (--pipeline-model-parallel-size)."""
    dp: int = 1
    """Data-parallel size (derived from world size by the launcher)."""
    vpp: int = 1
    """Virtual pipeline stages per pipeline rank; 1 means no interleaving."""
    sequence_parallel: bool = False
    """Shard activations outside the tensor-parallel regions along the sequence (--sequence-parallel)."""
    cp: int = 1
    """Context-parallel size: ranks that split each sequence (--context-parallel-size)."""
    distopt_instances: int = 1
    """Copies of the distributed optimizer (--num-distributed-optimizer-instances): the dp x cp
    ranks of a (tp, pp) coordinate form this many instances of consecutive ranks; each instance
    shards the optimizer state over its ranks, so every shard is held once per instance."""

    def __post_init__(self) -> None:
        for name, flag in (
            ("tp", "--tensor-model-parallel-size"),
            ("pp", "--pipeline-model-parallel-size"),
            ("dp", "--data-parallel-size"),
            ("vpp", "--num-layers-per-virtual-pipeline-stage"),
            ("cp", "--context-parallel-size"),
            ("distopt_instances", "--num-distributed-optimizer-instances"),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{flag}: {name} must be a positive integer, got {value!r}")
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError(
                "--num-layers-per-virtual-pipeline-stage: virtual pipeline stages need "
                "--pipeline-model-parallel-size > 1"
            )
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError(
                "--sequence-parallel needs --tensor-model-parallel-size > 1 "
                "(with tp 1 there is nothing to shard the sequence over)"
            )
        if (self.dp * self.cp) % self.distopt_instances:
            raise LayoutError(
                f"--num-distributed-optimizer-instances ({self.distopt_instances}) must divide "
                f"the data-parallel size ({self.dp}) x --context-parallel-size ({self.cp})"
            )

    def with_distopt_instances(self, requested: int) -> Layout:
        """This layout with `requested` optimizer instances where they divide dp x cp, else
        with one (no replicated shards); `distopt_instances` says which it got."""
        fits = requested < 1 or (self.dp * self.cp) % requested == 0  # < 1: refused by name
        return dataclasses.replace(self, distopt_instances=requested if fits else 1)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp

    def validate(
        self,
        *,
        num_layers: int,
        num_attention_heads: int,
        num_query_groups: int | None = None,
        seq_length: int | None = None,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
    ) -> None:
        """Check the layout against the model and batch; raise `LayoutError` naming the flag."""
        if num_attention_heads % self.tp:
            raise LayoutError(
                f"--num-attention-heads ({num_attention_heads}) must be divisible by "
                f"--tensor-model-parallel-size ({self.tp})"
            )
        groups = num_query_groups or num_attention_heads
        if groups % self.tp:
            raise LayoutError(
                f"--num-query-groups ({groups}) must be divisible by "
                f"--tensor-model-parallel-size ({self.tp})"
            )
        stages = self.pp * self.vpp
        if num_layers % stages:
            flag = (
                "--num-layers-per-virtual-pipeline-stage"
                if self.vpp > 1
                else "--pipeline-model-parallel-size"
            )
            raise LayoutError(
                f"--num-layers ({num_layers}) must be divisible by pipeline stages x virtual "
                f"stages ({self.pp} x {self.vpp}); change {flag}"
            )
        if self.sequence_parallel and seq_length is not None and seq_length % self.tp:
            raise LayoutError(
                f"--seq-length ({seq_length}) must be divisible by --tensor-model-parallel-size "
                f"({self.tp}) with --sequence-parallel"
            )
        if self.cp > 1 and seq_length is not None:
            check_cp_seq_length(seq_length, self.cp, self.tp if self.sequence_parallel else 1)
        if global_batch_size is not None and micro_batch_size is not None:
            if global_batch_size % (micro_batch_size * self.dp):
                raise LayoutError(
                    f"--global-batch-size ({global_batch_size}) must be divisible by "
                    f"--micro-batch-size ({micro_batch_size}) x data-parallel size ({self.dp})"
                )
            if self.vpp > 1:
                micro = global_batch_size // (micro_batch_size * self.dp)
                check_interleaved_microbatches(micro, self.pp)

    @staticmethod
    def from_world(
        world_size: int,
        tp: int = 1,
        pp: int = 1,
        vpp: int = 1,
        sequence_parallel: bool = False,
        cp: int = 1,
    ) -> Layout:
        """The layout that fills `world_size` ranks with the given tp, cp and pp."""
        Layout(tp=tp, pp=pp, vpp=vpp, cp=cp)  # a degree below 1 is refused, naming its flag
        if world_size % (tp * cp * pp):
            with_cp = f" x --context-parallel-size ({cp})" if cp > 1 else ""
            raise LayoutError(
                f"world size ({world_size}) must be a multiple of --tensor-model-parallel-size "
                f"({tp}){with_cp} x --pipeline-model-parallel-size ({pp})"
            )
        return Layout(
            tp=tp,
            pp=pp,
            dp=world_size // (tp * cp * pp),
            vpp=vpp,
            sequence_parallel=sequence_parallel,
            cp=cp,
        )


def check_cp_seq_length(seq_length: int, cp: int, sp_tp: int = 1) -> None:
    """Refuse a sequence length that does not split into 2 x cp equal chunks (x tp under
    sequence parallelism, which splits each rank's chunks again over tp)."""
    if seq_length % (2 * cp * sp_tp):
        sp = (
            f" x --tensor-model-parallel-size ({sp_tp}) under --sequence-parallel"
            if sp_tp > 1
            else ""
        )
        raise LayoutError(
            f"--seq-length ({seq_length}) must be divisible by 2 x --context-parallel-size "
            f"({cp}){sp}: each cp rank holds two chunks of every sequence"
        )


def check_interleaved_microbatches(num_microbatches: int, pp: int) -> None:
    """Refuse micro batch counts the interleaved schedule cannot run (at startup, for a planned
    or requested layout, and by the schedule itself under a batch-size ramp-up)."""
    if num_microbatches % pp:
        raise LayoutError(
            f"--num-layers-per-virtual-pipeline-stage: the interleaved pipeline schedule needs "
            f"the number of micro batches per step ({num_microbatches}) to be a multiple of "
            f"--pipeline-model-parallel-size ({pp}); micro batches = --global-batch-size / "
            "(--micro-batch-size x data-parallel size): change --global-batch-size or "
            "--micro-batch-size, or drop --num-layers-per-virtual-pipeline-stage"
        )


def num_layers_per_chunk(layout: Layout, num_layers: int) -> int:
    return num_layers // (layout.pp * layout.vpp)


def chunk_layer_range(layout: Layout, num_layers: int, pp_rank: int, chunk: int) -> range:
    """Global layer indices of virtual chunk `chunk` on pipeline rank `pp_rank`.

    Chunks are assigned round-robin as in Megatron's interleaved schedule: virtual stage
    `chunk * pp + pp_rank` holds consecutive layers.
    """
    per = num_layers_per_chunk(layout, num_layers)
    stage = chunk * layout.pp + pp_rank
    return range(stage * per, (stage + 1) * per)


def canonical_members(layout: Layout, members) -> tuple[int, ...]:
    """`members` reordered so that every tp and dp group lists its ranks in ascending order.

    torch numbers the ranks of a process group in ascending global order, and megadyn's layers
    take their tp / cp / dp coordinate from that number; so within each pipeline stage the ranks
    are sorted and laid out tp-fastest. The order of the stages is kept.
    """
    members = tuple(int(m) for m in members)
    per_stage = layout.tp * layout.cp * layout.dp
    out: list[int] = []
    for p in range(len(members) // per_stage if per_stage else 0):
        out += sorted(members[p * per_stage : (p + 1) * per_stage])
    return tuple(out) + members[len(out) :]


@dataclass(frozen=True)
class RankGrid:
    """A layout drawn over an ordered list of member ranks (see `canonical_members`)."""

    layout: Layout
    members: tuple[int, ...]

    def __post_init__(self) -> None:
        lay = self.layout
        if len(self.members) != lay.world_size:
            cp = f" x cp={lay.cp}" if lay.cp > 1 else ""
            raise LayoutError(
                f"the layout tp={lay.tp}{cp} x pp={lay.pp} x dp={lay.dp} "
                f"needs {lay.world_size} ranks, but {len(self.members)} members were "
                f"given: {list(self.members)}"
            )
        if len(set(self.members)) != len(self.members):
            raise LayoutError(f"member ranks repeat: {list(self.members)}")

    def rank_of(self, coords: Coords) -> int:
        t, c, d = self.layout.tp, self.layout.cp, self.layout.dp
        return self.members[coords.tp + (coords.cp + (coords.dp + coords.pp * d) * c) * t]

    def coords_of(self, rank: int) -> Coords:
        if rank not in self.members:
            raise LayoutError(f"rank {rank} is not a member of this layout {list(self.members)}")
        pos = self.members.index(rank)
        t, c, d = self.layout.tp, self.layout.cp, self.layout.dp
        return Coords(tp=pos % t, cp=(pos // t) % c, dp=(pos // (t * c)) % d, pp=pos // (t * c * d))

    def _groups(self, inner: str | tuple[str, ...]) -> list[list[int]]:
        """One group per value of the other coordinates: the ranks that differ only in the
        `inner` coordinates (the first of them fastest), groups in Megatron's rank order."""
        inner = (inner,) if isinstance(inner, str) else inner
        lay = self.layout
        sizes = {"tp": lay.tp, "cp": lay.cp, "dp": lay.dp, "pp": lay.pp}
        outer = [k for k in ("tp", "cp", "dp", "pp") if k not in inner]
        groups = []
        for out in itertools.product(*(range(sizes[k]) for k in reversed(outer))):
            fixed = dict(zip(reversed(outer), out))
            ranks = []
            for inn in itertools.product(*(range(sizes[k]) for k in reversed(inner))):
                coords = {**fixed, **dict(zip(reversed(inner), inn))}
                ranks.append(self.rank_of(Coords(**coords)))
            groups.append(ranks)
        return groups

    def tp_groups(self) -> list[list[int]]:
        return self._groups("tp")

    def cp_groups(self) -> list[list[int]]:
        """The ranks that split one sequence: weights replicated, activations split."""
        return self._groups("cp")

    def dp_groups(self) -> list[list[int]]:
        return self._groups("dp")

    def dp_cp_groups(self) -> list[list[int]]:
        """The ranks that hold the same weights (dp x cp, cp fastest): gradients reduce over
        them and the distributed optimizer shards over them."""
        return self._groups(("cp", "dp"))

    def pp_groups(self) -> list[list[int]]:
        return self._groups("pp")

    def intra_distopt_groups(self) -> list[list[int]]:
        """The ranks of one distributed-optimizer instance: each dp x cp group cut into
        `distopt_instances` runs of consecutive ranks. The optimizer state is sharded over
        them, gradients are reduce-scattered and parameters all-gathered within them."""
        size = self.layout.dp * self.layout.cp // self.layout.distopt_instances
        return [g[i : i + size] for g in self.dp_cp_groups() for i in range(0, len(g), size)]

    def inter_distopt_groups(self) -> list[list[int]]:
        """The ranks that hold the same optimizer shard, one per instance: the shard's
        gradients are all-reduced over them after the reduce-scatter."""
        size = self.layout.dp * self.layout.cp // self.layout.distopt_instances
        return [g[i::size] for g in self.dp_cp_groups() for i in range(size)]

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups: all tp x pp ranks of one (dp, cp) coordinate."""
        return self._groups(("tp", "pp"))

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each pipeline, which share tied embeddings."""
        groups = []
        for ranks in self.pp_groups():
            groups.append([ranks[0], ranks[-1]] if len(ranks) > 1 else [ranks[0]])
        return groups
