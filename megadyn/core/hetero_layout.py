"""A heterogeneous layout: data-parallel replicas of different pipeline depth, pure Python.

    lay = HeteroLayout(tp=1, num_layers=8, replicas=(
        Replica(stage_layers=(range(0, 3), range(3, 6), range(6, 8)), members=(0, 1, 2),
                micro_batches=5),
        Replica(stage_layers=(range(0, 4), range(4, 8)), members=(3, 4), micro_batches=3),
    ))
    lay.layer_ranges()       # [0:3) [3:4) [4:6) [6:8): cut at every replica's stage boundary
    lay.reduce_groups()      # per range and tp rank: the ranks holding it in every replica

A replica is one pipeline (tp x stages ranks, tp fastest within a stage, then stage by stage);
replicas share tp but not their depth or where their stages cut the layers (pipeline templates,
megadyn/elastic/planning/templates.py). A global step runs `micro_batches` micro batches on each replica
(together the global batch); every weight's gradient is summed over the ranks that hold it in
every replica: one group per layer range and tp rank, plus the embedding ends:
- `word_embeddings`: first stages, and last stages when the output layer is tied to it;
- `position_embeddings`: first stages; `final_layernorm` / `output_layer`: last stages.
The distributed optimizer shards each group's optimizer state over its ranks.

A homogeneous (tp, pp, dp) grid is the special case of dp equal replicas (`from_grid`).
Nothing here touches torch.distributed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from megadyn.core.layout import Layout, LayoutError


class HeteroCoords(NamedTuple):
    """Where one rank sits: which replica, which stage of it, which tp rank."""

    replica: int
    stage: int
    tp: int


def reduce_part(name: str, layer_ranges: Sequence[range]) -> range | str:
    """The reduce part of a global parameter name (megadyn/models/sharding.py's names): the
    layer range holding it, or the embedding end it belongs to."""
    head, _, rest = name.partition(".")
    if head == "embedding":
        return rest.split(".")[0]  # word_embeddings or position_embeddings
    if head == "decoder" and rest.startswith("layers."):
        layer = int(rest.split(".")[1])
        return next(r for r in layer_ranges if layer in r)
    return "final_layernorm"  # the final norm and an untied output layer: the last stages


class ReduceGroup(NamedTuple):
    """Ranks holding the same weights in every replica: `part` is a layer range or the name of
    an embedding end ('word_embeddings', 'position_embeddings', 'final_layernorm')."""

    part: range | str
    tp_rank: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Replica:
    """One pipeline of a heterogeneous layout."""

    stage_layers: tuple[range, ...]
    """Global layer indices of each stage, consecutive, covering every layer."""
    members: tuple[int, ...]
    """Global ranks, stage-major with tp fastest: stage s, tp rank t is members[s * tp + t]."""
    micro_batches: int
    """Micro batches this replica runs per global step."""

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    def stage_ranks(self, stage: int, tp: int) -> tuple[int, ...]:
        return self.members[stage * tp : (stage + 1) * tp]

    def stage_of_layer(self, layer: int) -> int:
        return next(s for s, r in enumerate(self.stage_layers) if layer in r)


@dataclass(frozen=True)
class HeteroLayout:
    """Replicas of any pipeline depth over disjoint ranks, tp equal across replicas."""

    tp: int
    num_layers: int
    replicas: tuple[Replica, ...]
    tied_embeddings: bool = True
    """The output layer reuses the word embedding (--untie-embeddings-and-output-weights off)."""

    def __post_init__(self) -> None:
        if not self.replicas:
            raise LayoutError("a heterogeneous layout needs at least one replica")
        Layout(tp=self.tp)  # a tp below 1 is refused, naming its flag
        seen: set[int] = set()
        for i, rep in enumerate(self.replicas):
            stops = [r.start for r in rep.stage_layers] + [self.num_layers]
            if stops[0] != 0 or any(
                r.stop != stops[s + 1] or len(r) < 1 for s, r in enumerate(rep.stage_layers)
            ):
                raise LayoutError(
                    f"replica {i}: stage layers {[(r.start, r.stop) for r in rep.stage_layers]} "
                    f"must be consecutive, non-empty ranges covering --num-layers "
                    f"({self.num_layers})"
                )
            if len(rep.members) != rep.num_stages * self.tp:
                raise LayoutError(
                    f"replica {i}: {rep.num_stages} stages x --tensor-model-parallel-size "
                    f"({self.tp}) need {rep.num_stages * self.tp} ranks, got {list(rep.members)}"
                )
            if seen & set(rep.members) or len(set(rep.members)) != len(rep.members):
                raise LayoutError(f"replica {i}: member ranks repeat: {list(rep.members)}")
            seen |= set(rep.members)
            if rep.micro_batches < 1:
                raise LayoutError(f"replica {i} runs no micro batch ({rep.micro_batches})")

    # --- sizes and coordinates ------------------------------------------------------------
    @property
    def members(self) -> tuple[int, ...]:
        return tuple(m for rep in self.replicas for m in rep.members)

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def num_microbatches(self) -> int:
        """Micro batches of one global step, all replicas together."""
        return sum(rep.micro_batches for rep in self.replicas)

    def coords_of(self, rank: int) -> HeteroCoords:
        for i, rep in enumerate(self.replicas):
            if rank in rep.members:
                pos = rep.members.index(rank)
                return HeteroCoords(i, pos // self.tp, pos % self.tp)
        raise LayoutError(f"rank {rank} is not a member of this layout {list(self.members)}")

    def replica_layout(self, index: int) -> Layout:
        """The replica as a one-pipeline grid (tp, pp = its stages, dp 1): its tp, pp and
        embedding groups are that grid's."""
        return Layout(tp=self.tp, pp=self.replicas[index].num_stages)

    def microbatch_offset(self, index: int) -> int:
        """Micro batches of the step that replicas before `index` run: where its own start."""
        return sum(rep.micro_batches for rep in self.replicas[:index])

    # --- gradient reduction -----------------------------------------------------------------
    def layer_ranges(self) -> list[range]:
        """[0, num_layers) cut at every stage boundary of every replica: within one range,
        each replica holds all layers on one stage."""
        cuts = sorted({r.start for rep in self.replicas for r in rep.stage_layers})
        return [range(a, b) for a, b in zip(cuts, cuts[1:] + [self.num_layers])]

    def _ranks_of_stage(self, which, tp_rank: int) -> tuple[int, ...]:
        ranks = set()
        for rep in self.replicas:
            for stage in which(rep):
                ranks.add(rep.stage_ranks(stage, self.tp)[tp_rank])
        return tuple(sorted(ranks))

    def reduce_groups(self) -> list[ReduceGroup]:
        """Every group gradients are summed over, in one order (every process creates them in
        this order): layer ranges first, then the embedding ends; ranks ascending."""
        first, last = (lambda rep: [0]), (lambda rep: [rep.num_stages - 1])
        both = lambda rep: sorted({0, rep.num_stages - 1})  # noqa: E731
        parts: list[tuple[range | str, object]] = [
            (r, lambda rep, r=r: [rep.stage_of_layer(r.start)]) for r in self.layer_ranges()
        ]
        parts += [
            ("word_embeddings", both if self.tied_embeddings else first),
            ("position_embeddings", first),
            ("final_layernorm", last),
        ]
        return [
            ReduceGroup(part, t, self._ranks_of_stage(which, t))
            for part, which in parts
            for t in range(self.tp)
        ]

    def groups_of(self, rank: int) -> list[ReduceGroup]:
        """The reduce groups `rank` takes part in."""
        return [g for g in self.reduce_groups() if rank in g.ranks]

    # --- grids as replicas ------------------------------------------------------------------
    @staticmethod
    def from_grid(
        layout: Layout, members, num_layers: int, num_microbatches: int, tied: bool = True
    ) -> HeteroLayout:
        """The grid `layout` (vpp 1, cp 1) over `members` (Megatron's rank order) as dp equal
        replicas, each running `num_microbatches` micro batches."""
        if layout.vpp != 1 or layout.cp != 1:
            raise LayoutError("only grids without virtual stages or cp are replicas of one depth")
        per = num_layers // layout.pp
        stages = tuple(range(s * per, (s + 1) * per) for s in range(layout.pp))
        t, d = layout.tp, layout.dp
        replicas = tuple(
            Replica(
                stages,
                tuple(
                    members[tr + dr * t + s * t * d] for s in range(layout.pp) for tr in range(t)
                ),
                num_microbatches,
            )
            for dr in range(d)
        )
        return HeteroLayout(layout.tp, num_layers, replicas, tied)

    @property
    def pp(self) -> int:
        """Stages of the first replica (the deepest of a planner's mix): the pipeline ranks
        whose RNG streams a reconfiguration hands over (megadyn/elastic/recovery/rng_handover.py)."""
        return self.replicas[0].num_stages

    @property
    def cp(self) -> int:
        """Context parallelism does not run with templates: always 1."""
        return 1

    @property
    def dp(self) -> int:
        """Replicas: each holds the whole model, as a grid's data-parallel ranks do."""
        return len(self.replicas)

    @property
    def name(self) -> str:
        """e.g. 'tp1x[pp3+pp2]' (the reconfiguration events' form of a layout)."""
        return f"tp{self.tp}x[" + "+".join(f"pp{r.num_stages}" for r in self.replicas) + "]"

    def to_dict(self) -> dict:
        """The JSON form (records through the control store, checkpoint metadata)."""
        return {
            "heterogeneous": True,
            "tp": self.tp,
            "num_layers": self.num_layers,
            "tied_embeddings": self.tied_embeddings,
            "replicas": [
                {
                    "stages": [[r.start, r.stop] for r in rep.stage_layers],
                    "members": list(rep.members),
                    "micro_batches": rep.micro_batches,
                }
                for rep in self.replicas
            ],
        }

    @staticmethod
    def from_dict(fields: dict) -> HeteroLayout:
        replicas = tuple(
            Replica(
                tuple(range(a, b) for a, b in rep["stages"]),
                tuple(rep["members"]),
                rep["micro_batches"],
            )
            for rep in fields["replicas"]
        )
        return HeteroLayout(fields["tp"], fields["num_layers"], replicas, fields["tied_embeddings"])

    def describe(self) -> str:
        """One line per replica, e.g. 'replica 0: 3 stages, layers 0-2 | 3-5 | 6-7, ranks
        [0, 1, 2], 5 micro batches'."""
        lines = []
        for i, rep in enumerate(self.replicas):
            cuts = " | ".join(f"{r.start}-{r.stop - 1}" for r in rep.stage_layers)
            lines.append(
                f"replica {i}: {rep.num_stages} stages, layers {cuts}, ranks "
                f"{list(rep.members)}, {rep.micro_batches} micro batches"
            )
        return "\n".join(lines)


def layout_to_dict(layout: Layout | HeteroLayout) -> dict:
    """The JSON form of a grid or a heterogeneous layout (`layout_from_dict` reads it)."""
    if isinstance(layout, HeteroLayout):
        return layout.to_dict()
    return dataclasses.asdict(layout)


def layout_from_dict(fields: dict) -> Layout | HeteroLayout:
    if fields.get("heterogeneous"):
        return HeteroLayout.from_dict(fields)
    return Layout(**fields)
