"""Pipeline templates: for each stage count, the layers of each stage, balanced by the cost model.

    model = StageModel.read(planner, tp=1, micro_batch_size=2, recompute=rc, replicas=3)
    template = PipelineTemplate.balance(model, num_layers=24, stages=3)
    template.stage_layers        # (range(0, 9), range(9, 17), range(17, 24)): the output layer
    template.replica_seconds(8)  # one replica's 1F1B time for 8 micro batches

A template is one pipeline specification (Oobleck's pipeline template): how many stages and
which consecutive layers each holds, so that the slowest stage is as fast as it can be. The
first stage also runs the embedding, the last the final norm, the output layer and the loss;
the output layer of a large vocabulary costs as much as a few layers, so the last stage gets
fewer layers. A stage must fit in memory: 1F1B keeps S - i micro batches of activations alive
on stage i of S, and the distributed optimizer shards the fp32 state over the replicas.

`StageModel` takes its numbers from the layout planner's own models (planning/layouts.py:
`memory_gib`, `CostModel.step_seconds`) and duplicates none of their terms: both are linear in
the layer count and the micro batch size, so a 1- and a 2-layer model, at micro batch b and 2b,
give one layer's time, weights and activations and the ends' (embedding, output layer, logits)
by differences. A calibrated cost model calibrates the templates too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

from megadyn.core.layout import Layout
from megadyn.core.recompute import RecomputeConfig
from megadyn.elastic.planning.layouts import LayoutPlanner, memory_gib, num_params


@dataclass(frozen=True)
class StageModel:
    """Per micro batch seconds and per rank GiB of the parts a stage can hold."""

    layer_seconds: float
    """Forward + backward of one transformer layer (tp collectives included)."""
    head_seconds: float
    """Final norm, output layer and loss, on the last stage: all the time outside the layers,
    since the cost model prices the first stage's embedding lookup at nothing (no FLOPs)."""
    layer_gib: float
    """Weights, gradient buffer and optimizer state of one layer."""
    ends_gib: float
    """The same for the embedding and output weights (held by first and last stage)."""
    layer_activation_gib: float
    """Activations one micro batch keeps alive in one layer until its backward."""
    logits_gib: float
    """The logits and softmax of one micro batch on the last stage."""
    reduce_seconds_per_param: float
    """Gradient reduction over the replicas, per parameter of a stage (its tp ranks reduce
    their shares side by side)."""
    layer_params: int
    ends_params: int

    @staticmethod
    def read(
        planner: LayoutPlanner,
        *,
        tp: int,
        micro_batch_size: int,
        recompute: RecomputeConfig,
        replicas: int,
    ) -> StageModel:
        """The planner's models for tp ranks per stage, micro batch size b and `replicas`
        pipelines sharing each layer, read off by differences (see the module docstring)."""
        return _read(planner, tp, micro_batch_size, recompute, replicas)


def _read(planner: LayoutPlanner, tp: int, b: int, rc: RecomputeConfig, replicas: int):
    cfg, seq, distopt, cost = planner.cfg, planner.seq, planner.distopt, planner.cost
    one, two = replace(cfg, num_layers=1), replace(cfg, num_layers=2)
    sp = tp > 1
    grid = Layout(tp=tp, dp=replicas, sequence_parallel=sp)
    single = Layout(tp=tp, sequence_parallel=sp)

    def mem(c, mbs):
        return memory_gib(c, grid, mbs, seq, rc, distopt)

    def secs(c, lay, gbs):
        return cost.step_seconds(c, lay, b, gbs, seq, rc)

    layer_act = (mem(two, 2 * b) - mem(one, 2 * b)) - (mem(two, b) - mem(one, b))
    layer_gib = mem(two, b) - mem(one, b) - layer_act
    logits = mem(one, 2 * b) - mem(one, b) - layer_act
    ends_gib = mem(one, b) - layer_gib - layer_act - logits
    layer_s = secs(two, single, b) - secs(one, single, b)
    reduce_s = secs(one, grid, b * replicas) - secs(one, single, b)
    layer_params = num_params(two) - num_params(one)
    return StageModel(
        layer_seconds=layer_s,
        head_seconds=secs(one, single, b) - layer_s,
        layer_gib=layer_gib,
        ends_gib=ends_gib,
        layer_activation_gib=layer_act,
        logits_gib=logits,
        reduce_seconds_per_param=reduce_s / num_params(one),
        layer_params=layer_params,
        ends_params=num_params(one) - layer_params,
    )


@dataclass(frozen=True, eq=False)  # compared and hashed as the object: planners cache them
class PipelineTemplate:
    """A pipeline of `len(stage_layers)` stages and what each stage costs."""

    stage_layers: tuple[range, ...]
    stage_seconds: tuple[float, ...]
    """Forward + backward of one micro batch on each stage."""
    stage_gib: tuple[float, ...]
    """Peak memory of each stage's ranks under 1F1B."""
    stage_params: tuple[int, ...]
    """Parameters of each stage (its tp ranks together)."""
    reduce_seconds_per_param: float

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    def replica_seconds(self, micro_batches: int) -> float:
        """1F1B time of `micro_batches`: the first micro batch passes every stage, the others
        follow at the pace of the slowest stage (with equal stages: (m + S - 1) x t)."""
        return self._fill_seconds + (micro_batches - 1) * self._pace_seconds

    @cached_property
    def _fill_seconds(self) -> float:
        return sum(self.stage_seconds)

    @cached_property
    def _pace_seconds(self) -> float:
        return max(self.stage_seconds)

    def reduce_seconds(self) -> float:
        """The slowest stage's gradient reduction over the replicas."""
        return max(self.stage_params) * self.reduce_seconds_per_param

    @staticmethod
    def stage_cost(model: StageModel, layers: int, stage: int, stages: int):
        """(seconds, GiB, params) of `layers` layers as stage `stage` of `stages`."""
        first, last = stage == 0, stage == stages - 1
        seconds = layers * model.layer_seconds
        seconds += model.head_seconds * last
        in_flight = stages - stage
        gib = layers * (model.layer_gib + in_flight * model.layer_activation_gib)
        gib += model.ends_gib * (first or last) + model.logits_gib * last
        params = layers * model.layer_params + model.ends_params * (first or last)
        return seconds, gib, params

    @staticmethod
    def balance(
        model: StageModel, num_layers: int, stages: int, memory_limit_gib: float = float("inf")
    ) -> PipelineTemplate | None:
        """The split of `num_layers` layers into `stages` non-empty stages whose slowest stage
        is fastest, every stage within `memory_limit_gib` (None when no split fits). Layers
        cost alike, so for a bound T on a stage's time each stage can hold at most some number
        of layers; the smallest T whose bounds add up to `num_layers` is the answer, and the
        layers fill the stages from the last one back (early stages, which keep more micro
        batches alive under 1F1B, get the fewest)."""
        if not 1 <= stages <= num_layers:
            return None

        def capacity(stage: int, bound: float) -> int:
            """The most layers stage `stage` can hold within `bound` seconds and the memory."""
            secs, gib, _ = PipelineTemplate.stage_cost(model, 1, stage, stages)
            per_gib = PipelineTemplate.stage_cost(model, 2, stage, stages)[1] - gib
            most = num_layers
            if model.layer_seconds > 0:
                most = min(most, 1 + math.floor((bound - secs) / model.layer_seconds + 1e-9))
            if per_gib > 0 and math.isfinite(memory_limit_gib):
                most = min(most, 1 + math.floor((memory_limit_gib - gib) / per_gib + 1e-9))
            return max(0, most) if gib <= memory_limit_gib and secs <= bound + 1e-12 else 0

        bounds = sorted({
            PipelineTemplate.stage_cost(model, k, s, stages)[0]
            for s in {0, stages // 2, stages - 1} for k in range(1, num_layers + 1)
        })  # fmt: skip

        def fits(bound: float) -> bool:
            caps = [capacity(s, bound) for s in range(stages)]
            return min(caps) >= 1 and sum(caps) >= num_layers

        lo, hi = 0, len(bounds) - 1
        if not fits(bounds[hi]):
            return None
        while lo < hi:  # the smallest bound that fits
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(bounds[mid]) else (mid + 1, hi)
        sizes, left = [1] * stages, num_layers - stages
        for s in range(stages - 1, -1, -1):
            extra = min(left, capacity(s, bounds[lo]) - 1)
            sizes[s] += extra
            left -= extra
        layers, start = [], 0
        for k in sizes:
            layers.append(range(start, start + k))
            start += k
        costs = [
            PipelineTemplate.stage_cost(model, len(r), s, stages) for s, r in enumerate(layers)
        ]
        return PipelineTemplate(
            stage_layers=tuple(layers),
            stage_seconds=tuple(c[0] for c in costs),
            stage_gib=tuple(c[1] for c in costs),
            stage_params=tuple(c[2] for c in costs),
            reduce_seconds_per_param=model.reduce_seconds_per_param,
        )
