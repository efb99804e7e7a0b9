"""Choose a layout for a member count: a memory model says what fits, a cost model what is fast.

    planner = LayoutPlanner(cfg, global_batch_size=64, seq_length=2048, gpu_memory_gib=80)
    choice = planner.choose(num_members=6)              # best (layout, micro batch, recompute)
    planner.cost.calibrate([(layout, mbs, measured_step_seconds), ...])

The memory model counts weights, gradients and Adam state per rank (the distributed optimizer
shards the fp32 state over dp) and the activations 1F1B keeps alive on the first stage
(Korthikanti et al.: about s*b*h*(34 + 5*a*s/h) bytes per layer, divided by tp under sequence
parallelism; full recomputation keeps only the layer inputs). The cost model follows the PTD-P
paper's analysis: compute time from the model FLOPs, the pipeline bubble (pp - 1) / (vpp * m),
tensor-parallel all-reduces per layer and the data-parallel gradient reduction; its scale factors
are fitted to measured step times.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megadyn.core.layout import Layout, LayoutError
from megadyn.core.recompute import RecomputeConfig
from megadyn.models.config import GPTConfig
from megadyn.models.flops import model_flops_per_iteration
from megadyn.models.sharding import param_specs

GiB = 2**30


@dataclass(frozen=True)
class Choice:
    layout: Layout
    micro_batch_size: int
    recompute: RecomputeConfig
    memory_gib: float
    step_seconds: float


def num_params(cfg: GPTConfig) -> int:
    total = 0
    for spec in param_specs(cfg).values():
        n = 1
        for d in spec.shape:
            n *= d
        total += n
    return total


def memory_gib(
    cfg: GPTConfig,
    layout: Layout,
    micro_batch_size: int,
    seq_length: int,
    recompute: RecomputeConfig,
    distributed_optimizer: bool = True,
) -> float:
    """Peak memory of the busiest rank (the first pipeline stage), GiB."""
    params = num_params(cfg) / (layout.tp * layout.pp)
    state = 2 + 4  # bf16 weight + fp32 gradient buffer
    fp32_state = 12  # main weight + exp_avg + exp_avg_sq
    shards = max(1, layout.dp // layout.distopt_instances)  # ranks sharing one optimizer copy
    per_param = state + (fp32_state / shards if distributed_optimizer else fp32_state)
    s, b, h = seq_length, micro_batch_size, cfg.hidden_size
    tp = layout.tp
    # bytes per layer per micro batch (Korthikanti et al., flash attention: no s^2 term)
    if recompute.granularity == "full":
        per_layer = 2 * s * b * h / (tp if layout.sequence_parallel else 1)  # layer input only
    elif layout.sequence_parallel:
        per_layer = 34 * s * b * h / tp
    else:
        per_layer = s * b * h * (10 + 24 / tp)
    activations = (
        per_layer * cfg.num_layers / layout.pp * layout.pp
    )  # 1F1B: pp in flight on stage 0
    logits = 6 * s * b * cfg.vocab_size / tp  # fp32 softmax + bf16 logits on the last stage
    return (params * per_param + activations + logits) / GiB


@dataclass
class CostModel:
    """Step-time model; `compute_scale` and `comm_scale` are fitted by `calibrate`."""

    peak_flops: float = 989e12
    efficiency: float = 0.45
    tp_bandwidth: float = 150e9
    dp_bandwidth: float = 150e9
    compute_scale: float = 1.0
    comm_scale: float = 1.0
    samples: list = field(default_factory=list)

    def step_seconds(
        self,
        cfg: GPTConfig,
        layout: Layout,
        mbs: int,
        gbs: int,
        seq: int,
        recompute: RecomputeConfig,
    ) -> float:
        flops = model_flops_per_iteration(cfg, gbs, seq, layout.tp)
        if recompute.granularity == "full":
            flops *= 4 / 3
        compute = flops / (layout.world_size * self.peak_flops * self.efficiency)
        m = gbs // (mbs * layout.dp)
        bubble = (layout.pp - 1) / (layout.vpp * m)
        tp_bytes = 0.0
        if layout.tp > 1:  # 4 all-reduces of [s, b, h] bf16 per layer per micro batch (fwd + bwd)
            per = 4 * 2 * seq * mbs * cfg.hidden_size * 2 * (layout.tp - 1) / layout.tp
            tp_bytes = per * m * cfg.num_layers / layout.pp
        dp_bytes = 0.0
        if layout.dp > 1:
            dp_bytes = (
                2 * 4 * num_params(cfg) / (layout.tp * layout.pp) * (layout.dp - 1) / layout.dp
            )
        comm = tp_bytes / self.tp_bandwidth + dp_bytes / self.dp_bandwidth
        return self.compute_scale * compute * (1 + bubble) + self.comm_scale * comm

    def calibrate(self, cfg: GPTConfig, gbs: int, seq: int, measured: list[tuple]) -> None:
        """Fit `compute_scale` to measured (layout, mbs, recompute, seconds) step times."""
        self.samples += measured
        self.compute_scale = self.comm_scale = 1.0
        ratios = [
            t / self.step_seconds(cfg, lay, mbs, gbs, seq, rc) for lay, mbs, rc, t in self.samples
        ]
        if ratios:
            self.compute_scale = self.comm_scale = sum(ratios) / len(ratios)


class LayoutPlanner:
    def __init__(
        self,
        cfg: GPTConfig,
        *,
        global_batch_size: int,
        seq_length: int,
        gpu_memory_gib: float,
        distributed_optimizer: bool = True,
        cost: CostModel | None = None,
        micro_batch_sizes: tuple[int, ...] = (1, 2, 4),
        recomputes: tuple[RecomputeConfig, ...] | None = None,
    ):
        self.cfg, self.gbs, self.seq = cfg, global_batch_size, seq_length
        self.gpu_memory_gib, self.distopt = gpu_memory_gib, distributed_optimizer
        self.cost = cost or CostModel()
        self.micro_batch_sizes, self.recomputes = micro_batch_sizes, recomputes

    def candidates(self, num_members: int):
        cfg = self.cfg
        for tp in (t for t in (1, 2, 4, 8) if num_members % t == 0):
            for pp in (p for p in range(1, num_members // tp + 1) if (num_members // tp) % p == 0):
                dp = num_members // (tp * pp)
                for vpp in (1, 2) if pp > 1 else (1,):
                    for sp in (False, True) if tp > 1 else (False,):
                        layout = Layout(tp=tp, pp=pp, dp=dp, vpp=vpp, sequence_parallel=sp)
                        for mbs in self.micro_batch_sizes:
                            try:
                                layout.validate(
                                    num_layers=cfg.num_layers,
                                    num_attention_heads=cfg.num_attention_heads,
                                    num_query_groups=cfg.num_query_groups,
                                    seq_length=self.seq,
                                    global_batch_size=self.gbs,
                                    micro_batch_size=mbs,
                                )
                            except LayoutError:
                                continue
                            if vpp > 1 and (self.gbs // (mbs * dp)) % pp:
                                continue
                            for rc in self.recomputes or (
                                RecomputeConfig(),
                                RecomputeConfig("selective"),
                                RecomputeConfig("full", "uniform", 1),
                            ):
                                yield layout, mbs, rc

    def evaluate(self, layout: Layout, mbs: int, rc: RecomputeConfig) -> Choice:
        mem = memory_gib(self.cfg, layout, mbs, self.seq, rc, self.distopt)
        secs = self.cost.step_seconds(self.cfg, layout, mbs, self.gbs, self.seq, rc)
        return Choice(layout, mbs, rc, mem, secs)

    def choose(self, num_members: int, pinned: Layout | None = None) -> Choice:
        """The fastest choice that fits; raises LayoutError with the reason when none does."""
        options = [
            self.evaluate(*c)
            for c in self.candidates(num_members)
            if pinned is None or c[0] == pinned
        ]
        if not options:
            what = f"layout {pinned}" if pinned else f"{num_members} members"
            raise LayoutError(f"no valid layout for {what} (heads, layers, batch divisibility)")
        fitting = [c for c in options if c.memory_gib <= self.gpu_memory_gib]
        if not fitting:
            best = min(options, key=lambda c: c.memory_gib)
            raise LayoutError(
                f"the model does not fit on {num_members} members: the smallest choice needs "
                f"{best.memory_gib:.1f} GiB per GPU, {self.gpu_memory_gib:.1f} GiB available"
            )
        return min(fitting, key=lambda c: (c.step_seconds, c.memory_gib))
