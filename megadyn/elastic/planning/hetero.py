"""Plan a job of N members as replicas of different pipeline depth, from pipeline templates.

    planner = HeteroPlanner(LayoutPlanner(cfg, global_batch_size=64, seq_length=2048,
                                          gpu_memory_gib=80))
    plan = planner.plan(num_members=7)      # e.g. one 3-stage and two 2-stage replicas
    plan.micro_batches                      # (12, 10, 10): together the global batch
    layout = plan.layout(members=range(7), num_layers=cfg.num_layers)   # a HeteroLayout

For each tensor-parallel size, micro batch size and recomputation the planner takes templates
for stage counts from the smallest that fits memory, S0, to a largest (by default 2 S0 - 1, at
least S0 + 3: counts from S0 to 2 S0 - 1 add up to every member count from S0 on), and
enumerates every multiset of templates, as Oobleck does: it keeps those that use the most
members (N when any fits, else the largest sum below N), and of those the fastest. The global
batch's micro batches are split between replicas so that the slowest finishes first (each
micro batch goes to the replica it delays least: faster replicas run more); every replica runs
at least one, and together they run exactly global batch / micro batch size.

`grid_or_templates` is the choice of `--elastic-layout auto` with templates: the best grid,
unless a mix of templates uses more members and the models say it is faster.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from megadyn.core.hetero_layout import HeteroLayout, Replica
from megadyn.core.layout import LayoutError
from megadyn.core.recompute import RecomputeConfig
from megadyn.elastic.planning.layouts import Choice, LayoutPlanner
from megadyn.elastic.planning.templates import PipelineTemplate, StageModel


def split_microbatches(templates: list[PipelineTemplate], total: int) -> tuple[int, ...]:
    """Integer micro batches per replica, at least one each, summing to `total`, that minimise
    the slowest replica's time: after one each, the next micro batch always goes to the replica
    that would finish it first (earlier replicas first among equals). Replicas of one template
    advance together, a round of one micro batch each at a time."""
    if total < len(templates):
        raise LayoutError(
            f"{len(templates)} replicas need at least as many micro batches per step, got "
            f"{total}: raise --global-batch-size or lower --micro-batch-size"
        )
    kinds: dict[PipelineTemplate, list[int]] = {}
    for i, t in enumerate(templates):
        kinds.setdefault(t, []).append(i)
    counts = [1] * len(templates)
    # (finish time of the next round, first replica, template, round): one entry per template
    heap = [(t.replica_seconds(2), idx[0], t, 2) for t, idx in kinds.items()]
    heapq.heapify(heap)
    left = total - len(templates)
    while left:
        _, _, t, level = heapq.heappop(heap)
        for i in kinds[t][:left]:
            counts[i] = level
        left -= min(left, len(kinds[t]))
        heapq.heappush(heap, (t.replica_seconds(level + 1), kinds[t][0], t, level + 1))
    return tuple(counts)


@dataclass(frozen=True)
class HeteroPlan:
    """Replicas from templates, their micro batches and what the models say of the step."""

    tp: int
    micro_batch_size: int
    recompute: RecomputeConfig
    templates: tuple[PipelineTemplate, ...]
    """One per replica, deepest first."""
    micro_batches: tuple[int, ...]
    step_seconds: float
    memory_gib: float
    """Peak memory of the busiest rank."""

    @property
    def members_used(self) -> int:
        return self.tp * sum(t.num_stages for t in self.templates)

    def layout(self, members, num_layers: int, tied: bool = True) -> HeteroLayout:
        """The plan over the first `members_used` of `members`: replica by replica, stage by
        stage, tp fastest; each stage's ranks ascending, as torch numbers a group's ranks."""
        members = list(members)[: self.members_used]
        replicas, start = [], 0
        for template, micro in zip(self.templates, self.micro_batches):
            ranks: list[int] = []
            for _ in range(template.num_stages):
                ranks += sorted(members[start : start + self.tp])
                start += self.tp
            replicas.append(Replica(template.stage_layers, tuple(ranks), micro))
        return HeteroLayout(self.tp, num_layers, tuple(replicas), tied)

    def describe(self) -> str:
        """e.g. 'tp1: 1 x 3 stages + 2 x 2 stages, micro batch 2, 12/10/10 micro batches'."""
        depths = [t.num_stages for t in self.templates]
        kinds = " + ".join(
            f"{depths.count(s)} x {s} stages" for s in sorted(set(depths), reverse=True)
        )
        micro = "/".join(str(m) for m in self.micro_batches)
        return f"tp{self.tp}: {kinds}, micro batch {self.micro_batch_size}, {micro} micro batches"


def _multisets(values: list[int], count: int, total: int, start: int = 0):
    """Non-increasing tuples of `count` items of `values` (descending) summing to `total`."""
    if count == 0:
        if total == 0:
            yield ()
        return
    for i in range(start, len(values)):
        v = values[i]
        if v * count < total:  # the rest can only be smaller
            return
        if v + values[-1] * (count - 1) > total:
            continue
        for rest in _multisets(values, count - 1, total - v, i):
            yield (v, *rest)


class HeteroPlanner:
    """Pipeline templates and their mixes for a member count, on a `LayoutPlanner`'s models
    (its model config, batch, memory limit, micro batch sizes, recomputation choices)."""

    def __init__(self, planner: LayoutPlanner, max_stages: int | None = None):
        self.planner, self.max_stages = planner, max_stages
        self._templates: dict[tuple, PipelineTemplate | None] = {}
        self._models: dict[tuple, StageModel] = {}

    def template(self, tp: int, mbs: int, rc: RecomputeConfig, replicas: int, stages: int):
        """The balanced template of `stages` stages when `replicas` replicas share each layer
        (the distributed optimizer shards over them); None when it does not fit."""
        key = (tp, mbs, rc, replicas, stages)
        if key not in self._templates:
            p = self.planner
            if key[:4] not in self._models:
                self._models[key[:4]] = StageModel.read(
                    p, tp=tp, micro_batch_size=mbs, recompute=rc, replicas=replicas
                )
            model = self._models[key[:4]]
            self._templates[key] = PipelineTemplate.balance(
                model, p.cfg.num_layers, stages, p.gpu_memory_gib
            )
        return self._templates[key]

    def stage_counts(self, tp: int, mbs: int, rc: RecomputeConfig, replicas: int, most: int):
        """Stage counts with a template that fits, from the smallest (S0) to the largest of
        this planner, at most `most`."""
        layers = self.planner.cfg.num_layers
        smallest = next(
            (s for s in range(1, min(layers, most) + 1)
             if self.template(tp, mbs, rc, replicas, s) is not None),
            None,
        )  # fmt: skip
        if smallest is None:
            return []
        largest = self.max_stages or max(2 * smallest - 1, smallest + 3)
        return [
            s for s in range(smallest, min(largest, layers, most) + 1)
            if self.template(tp, mbs, rc, replicas, s) is not None
        ]  # fmt: skip

    def candidates(self, num_members: int):
        """(members used, tp, mbs, rc, depths) of every mix the planner considers: for each
        replica count, every multiset of templates from S0 to the largest stage count (Oobleck's
        enumeration) using the most members it can, and the mix of the two depths nearest
        N / (tp x replicas) using all (deep pipelines, beyond the enumerated range)."""
        p, cfg = self.planner, self.planner.cfg
        heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
        for tp in (t for t in (1, 2, 4, 8) if heads % t == 0 and groups % t == 0):
            if tp > num_members or (tp > 1 and p.seq % tp):
                continue
            slots = num_members // tp  # stages all replicas together can have
            for mbs in (b for b in p.micro_batch_sizes if p.gbs % b == 0):
                for rc in p.recomputes or (RecomputeConfig(), RecomputeConfig("selective"),
                                           RecomputeConfig("full", "uniform", 1)):  # fmt: skip
                    for replicas in range(1, min(slots, p.gbs // mbs) + 1):
                        counts = self.stage_counts(tp, mbs, rc, replicas, slots - replicas + 1)
                        if not counts:
                            continue
                        used = min(replicas * counts[-1], slots)
                        mixes = set(_multisets(counts[::-1], replicas, used))
                        depth, longer = divmod(slots, replicas)
                        even = (depth + 1,) * longer + (depth,) * (replicas - longer)
                        if all(self.template(tp, mbs, rc, replicas, s) for s in set(even)):
                            mixes.add(even)
                        for depths in mixes:
                            yield sum(depths) * tp, tp, mbs, rc, depths

    def evaluate(self, tp, mbs, rc, depths: tuple[int, ...]) -> HeteroPlan:
        replicas = len(depths)
        templates = [self.template(tp, mbs, rc, replicas, s) for s in depths]
        micro = split_microbatches(templates, self.planner.gbs // mbs)
        step = max(t.replica_seconds(m) for t, m in zip(templates, micro))
        step += max(t.reduce_seconds() for t in templates)
        memory = max(max(t.stage_gib) for t in templates)
        return HeteroPlan(tp, mbs, rc, tuple(templates), micro, step, memory)

    def plan(self, num_members: int) -> HeteroPlan:
        """The fastest mix of templates among those using the most members; raises
        LayoutError when no template fits."""
        candidates = list(self.candidates(num_members))
        if not candidates:
            raise LayoutError(
                f"no pipeline template fits {num_members} members "
                f"({self.planner.gpu_memory_gib:.1f} GiB per GPU)"
            )
        most = max(c[0] for c in candidates)
        plans = [self.evaluate(*c[1:]) for c in candidates if c[0] == most]
        return min(plans, key=lambda plan: (plan.step_seconds, plan.memory_gib))


def best_grid(planner: LayoutPlanner, num_members: int) -> Choice | None:
    """The fastest grid on at most `num_members` members (a grid may leave members idle when
    none fits them all); None when no grid fits."""
    best = None
    for n in range(1, num_members + 1):
        try:
            choice = planner.choose(n)
        except LayoutError:
            continue
        if best is None or choice.step_seconds < best.step_seconds:
            best = choice
    return best


def templates_win(grid: Choice | None, plan: HeteroPlan | None) -> bool:
    """Whether `--elastic-layout auto` takes the templates' plan over the grid: it uses more
    members and is modelled faster (or no grid fits)."""
    if plan is None:
        return False
    return grid is None or (
        plan.members_used > grid.layout.world_size and plan.step_seconds < grid.step_seconds
    )


def grid_or_templates(hetero: HeteroPlanner, num_members: int) -> Choice | HeteroPlan:
    """The best grid, or the templates' plan when `templates_win`; LayoutError when neither
    fits."""
    grid = best_grid(hetero.planner, num_members)
    try:
        plan = hetero.plan(num_members)
    except LayoutError:
        plan = None
    if grid is None and plan is None:
        raise LayoutError(f"neither a grid nor pipeline templates fit {num_members} members")
    return plan if templates_win(grid, plan) else grid
