"""Layouts by sequence length (--dynamic-parallelism): which layout runs which samples.

With variable-length samples the fastest layout depends on the length: short samples train
fastest data-parallel, long ones need tensor parallelism to fit. Over the same processes as
the job's (base) layout, the planner weighs every layout of tp x dp ranks (pp 1, cp 1, no
sequence parallelism) for every sample length with the layout planner's models
(planning/layouts.py):

- memory: a layout other than the base holds a copy of the weights and gradients (no
  optimizer); every layout runs beside the base layout's model and optimizer and the other
  chosen layouts' copies (all stay allocated), plus the activations of one micro batch; its
  micro-batch token budget is the most tokens that fit (at most --micro-batch-tokens), and a
  length it cannot hold is not its to run (planned once without the copies, then again with
  those of the layouts chosen);
- time: the PTD-P cost of a step of such samples (its attention term grows with the square of
  the length; tp adds its all-reduces, dp its gradient reduction) per sample.

Each length goes to the cheapest layout that fits; the lengths at which the choice changes are
the group boundaries. Pure: no processes.

    plan = plan_length_groups(model_cfg, base, budget=8192, seq_length=8192,
                              global_batch_size=64, gpu_memory_gib=80)
    plan.groups                     # (LengthGroup(layout, max_tokens, lengths), ...)
    plan.assign([120, 7000, 300])   # positions per group: [[0, 2], [1]]
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from megadyn.core.layout import Layout, LayoutError
from megadyn.core.recompute import RecomputeConfig
from megadyn.elastic.planning.layouts import CostModel, memory_gib
from megadyn.models.config import GPTConfig


@dataclass(frozen=True)
class LengthGroup:
    """One layout of the plan and the sample lengths it runs."""

    layout: Layout
    max_tokens: int
    """Its micro-batch token budget: the most tokens one micro batch may hold (padding
    included) under this layout's memory."""
    lengths: tuple[tuple[int, int], ...]
    """Inclusive (shortest, longest) ranges of sample lengths it runs."""

    def describe(self) -> str:
        ranges = ", ".join(f"{lo}-{hi}" for lo, hi in self.lengths)
        return f"tp{self.layout.tp}xdp{self.layout.dp} for lengths {ranges}"


@dataclass(frozen=True)
class LengthPlan:
    base: Layout
    """The job's layout: the optimizer and the gradients of record live here."""
    groups: tuple[LengthGroup, ...]
    """Base first (where it runs any length), then by tp."""
    upper: tuple[int, ...]
    """upper[k]: the longest length of the k-th run of lengths ..."""
    owner: tuple[int, ...]
    """... and the group that runs it (lengths from 1 up, runs in order)."""

    def group_of(self, length: int) -> int:
        k = bisect.bisect_left(self.upper, length)
        if k == len(self.upper):
            raise ValueError(f"a sample of {length} tokens is above --seq-length")
        return self.owner[k]

    def assign(self, lengths: list[int]) -> list[list[int]]:
        """Positions into `lengths` per group (ascending in each)."""
        out = [[] for _ in self.groups]
        for i, n in enumerate(lengths):
            out[self.group_of(n)].append(i)
        return out


def candidate_layouts(cfg: GPTConfig, num_ranks: int) -> list[Layout]:
    """tp x dp layouts of `num_ranks` the model's heads allow (pp 1, cp 1, no SP)."""
    out = []
    for tp in (t for t in (1, 2, 4, 8) if num_ranks % t == 0):
        layout = Layout(tp=tp, dp=num_ranks // tp)
        try:
            layout.validate(
                num_layers=cfg.num_layers,
                num_attention_heads=cfg.num_attention_heads,
                num_query_groups=cfg.num_query_groups,
            )
        except LayoutError:
            continue
        out.append(layout)
    return out


def _max_tokens(fits, budget: int) -> int:
    """The largest token count in [0, budget] that `fits` (monotone), by bisection."""
    lo, hi = 0, budget
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def plan_length_groups(
    cfg: GPTConfig,
    base: Layout,
    *,
    budget: int,
    seq_length: int,
    global_batch_size: int,
    gpu_memory_gib: float,
    recompute: RecomputeConfig | None = None,
    distributed_optimizer: bool = True,
    cost: CostModel | None = None,
) -> LengthPlan:
    """The plan (module docstring); a length no layout holds is a LayoutError naming the
    memory flag."""
    rc, cost = recompute or RecomputeConfig(), cost or CostModel()
    layouts = [base] + [c for c in candidate_layouts(cfg, base.world_size) if c != base]
    # what each layout keeps allocated all step: the base its model and optimizer, another
    # layout its copy of the weights and gradients
    state = {
        c: memory_gib(cfg, c, 1, 0, rc, distributed_optimizer, optimizer=c == base) for c in layouts
    }

    def budgets_beside(held: set[Layout]) -> dict[Layout, int]:
        """Each layout's token budget while the copies of `held` (and the base) stay allocated."""

        def need(layout: Layout, tokens: int) -> float:
            others = sum(state[c] for c in held | {base} if c != layout)
            opt = layout == base
            return others + memory_gib(cfg, layout, 1, tokens, rc, distributed_optimizer, opt)

        return {
            c: _max_tokens(lambda t, c=c: need(c, t) <= gpu_memory_gib, budget) for c in layouts
        }

    def per_sample(layout: Layout, length: int) -> float:
        # many samples per step: the gradient reduction, paid once per step whatever the
        # grouping, drops out; what is left is compute (attention's s^2 in it) and tp traffic
        gbs = layout.dp * AMORTIZE
        return cost.step_seconds(cfg, layout, 1, gbs, length, rc) / gbs

    def best(length: int) -> Layout:
        fitting = [c for c in layouts if budgets[c] >= length]
        if not fitting:
            raise LayoutError(
                f"a sample of {length} tokens fits no layout of {base.world_size} ranks in "
                f"{gpu_memory_gib:g} GiB (--dynamic-parallelism-memory-gib); lower --seq-length"
            )
        return min(fitting, key=lambda c: (per_sample(c, length), layouts.index(c)))

    budgets = budgets_beside(set())
    upper, runs = _runs(best, seq_length, sorted(budgets.values()))
    if len(set(runs)) > 1:  # again with the chosen layouts' copies held beside each other
        budgets = budgets_beside(set(runs))
        upper, runs = _runs(best, seq_length, sorted(budgets.values()))
    chosen = sorted(set(runs), key=lambda c: (c != base, c.tp))
    firsts = [1] + [u + 1 for u in upper[:-1]]
    groups = tuple(
        LengthGroup(
            c,
            budgets[c],
            tuple((lo, hi) for lo, hi, r in zip(firsts, upper, runs) if r == c),
        )
        for c in chosen
    )
    return LengthPlan(base, groups, tuple(upper), tuple(chosen.index(r) for r in runs))


AMORTIZE = 2**20
"""Samples per dp rank the per-sample cost assumes (the step's fixed costs spread thin)."""


def _runs(best, seq_length: int, budgets: list[int]) -> tuple[list[int], list[Layout]]:
    """Runs of lengths 1..seq_length with the same `best` layout: (last length of each run,
    its layout). `best` is read on a grid (powers of 2 and their quarter steps, each layout's
    budget) and each change between grid points is bisected to its exact length (one change
    between neighbouring grid points is assumed)."""
    grid = {1, seq_length} | {b for b in budgets if 1 <= b <= seq_length}
    grid |= {b + 1 for b in budgets if 1 <= b < seq_length}
    p = 1
    while p < seq_length:
        grid |= {min(seq_length, p + p * q // 4) for q in range(4)}
        p *= 2
    points = sorted(grid)
    upper, runs = [], []
    prev, prev_best = points[0], best(points[0])
    upper.append(prev)
    runs.append(prev_best)
    for point in points[1:]:
        here = best(point)
        if here != prev_best:
            lo, hi = prev, point  # best(lo) == prev_best != best(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if best(mid) == prev_best else (lo, mid)
            upper[-1] = lo
            upper.append(point)
            runs.append(here)
        else:
            upper[-1] = point
        prev, prev_best = point, here
    return upper, runs
