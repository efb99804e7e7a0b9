"""Choose a layout for a member count: a memory model says what fits, a cost model what is fast.

    planner = LayoutPlanner(cfg, global_batch_size=64, seq_length=2048, gpu_memory_gib=80)
    choice = planner.choose(num_members=6)              # best (layout, micro batch, recompute)
    planner.cost.calibrate([(layout, mbs, measured_step_seconds), ...])

The memory model counts weights, gradients and Adam state per rank (the distributed optimizer
shards the fp32 state over dp x cp) and the activations 1F1B keeps alive on the first stage
(Korthikanti et al. with flash attention: about s*b*h*(10 + 24/tp) bytes per layer, 34*s*b*h/tp
under sequence parallelism, for the s / cp tokens a context-parallel rank holds; full
recomputation keeps only the layer inputs). The cost model follows the PTD-P paper's analysis:
compute time from the model FLOPs (their attention part grows with the square of the sequence),
the pipeline bubble (pp - 1) / (vpp * m), tensor-parallel all-reduces per layer, context
parallelism's ring of key/value exchanges and key/value-gradient returns (overlapped with
the blockwise attention of each ring step, so only what the attention does not hide costs
time) and the gradient reduction over dp x cp; its scale factors are fitted to measured step
times. Under cp the ring also keeps cp copies of the local keys and values per layer for its
backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megadyn.core.layout import Layout, LayoutError
from megadyn.core.recompute import RecomputeConfig
from megadyn.models.config import GPTConfig
from megadyn.models.flops import model_flops_per_iteration
from megadyn.models.sharding import num_params

GiB = 2**30


@dataclass(frozen=True)
class Choice:
    layout: Layout
    micro_batch_size: int
    recompute: RecomputeConfig
    memory_gib: float
    step_seconds: float


def memory_gib(
    cfg: GPTConfig,
    layout: Layout,
    micro_batch_size: int,
    seq_length: int,
    recompute: RecomputeConfig,
    distributed_optimizer: bool = True,
    optimizer: bool = True,
) -> float:
    """Peak memory of the busiest rank (the first pipeline stage), GiB. Without `optimizer`
    the layout holds weights and gradients only (a hot-switch group's copy of the model)."""
    params = num_params(cfg) / (layout.tp * layout.pp)
    state = 2 + 4  # bf16 weight + fp32 gradient buffer
    fp32_state = 12 if optimizer else 0  # main weight + exp_avg + exp_avg_sq
    # ranks sharing one optimizer copy: weights replicate over dp x cp
    shards = max(1, layout.dp * layout.cp // layout.distopt_instances)
    per_param = state + (fp32_state / shards if distributed_optimizer else fp32_state)
    s, b, h = seq_length // layout.cp, micro_batch_size, cfg.hidden_size  # this rank's tokens
    tp = layout.tp
    # bytes per layer per micro batch (Korthikanti et al., flash attention: no s^2 term; the
    # ring keeps the same q, k, v and output, of the local tokens)
    if recompute.granularity == "full":
        per_layer = 2 * s * b * h / (tp if layout.sequence_parallel else 1)  # layer input only
    elif layout.sequence_parallel:
        per_layer = 34 * s * b * h / tp
    else:
        per_layer = s * b * h * (10 + 24 / tp)
    if layout.cp > 1 and recompute.granularity != "full":
        # the ring keeps its own keys and values in one message and the cp - 1 it received
        per_layer += layout.cp * 2 * 2 * s * b * cfg.head_dim * cfg.query_groups / tp
    activations = (
        per_layer * cfg.num_layers / layout.pp * layout.pp
    )  # 1F1B: pp in flight on stage 0
    logits = 6 * s * b * cfg.vocab_size / tp  # fp32 softmax + bf16 logits on the last stage
    return (params * per_param + activations + logits) / GiB


def check_cp_heads(cfg: GPTConfig, layout: Layout) -> None:
    """--cp-comm-type a2a gives each cp rank a share of the key/value heads of its tp rank:
    a LayoutError unless cp divides them."""
    groups = cfg.query_groups // layout.tp
    if layout.cp > 1 and cfg.cp_comm_type == "a2a" and groups % layout.cp:
        raise LayoutError(
            f"--cp-comm-type a2a splits the key/value heads per tp rank ({groups}: "
            f"--num-query-groups / --tensor-model-parallel-size) over --context-parallel-size "
            f"({layout.cp}), which must divide them: use p2p or a smaller cp"
        )


def attention_flops(cfg: GPTConfig, batch_size: int, seq_length: int) -> float:
    """The part of `model_flops_per_iteration` that grows with the square of the sequence: the
    scores and their product with the values, 12 * B * s^2 * h per layer (forward + backward)."""
    return 12 * batch_size * seq_length**2 * cfg.hidden_size * cfg.num_layers


@dataclass
class CostModel:
    """Step-time model; `compute_scale` and `comm_scale` are fitted by `calibrate`."""

    peak_flops: float = 989e12
    efficiency: float = 0.45
    tp_bandwidth: float = 150e9
    dp_bandwidth: float = 150e9
    cp_bandwidth: float = 150e9
    """Bytes/s of one ring step's point-to-point exchange between neighbouring cp ranks."""
    memory_bandwidth: float = 3e12
    """Bytes/s of the GPU's memory: the ring's merges and gradient sums in fp32."""
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
            per = (
                4 * 2 * (seq // layout.cp) * mbs * cfg.hidden_size * 2 * (layout.tp - 1) / layout.tp
            )
            tp_bytes = per * m * cfg.num_layers / layout.pp
        dp_bytes = 0.0
        shards = layout.dp * layout.cp  # gradients reduce over dp x cp
        if shards > 1:
            dp_bytes = 2 * 4 * num_params(cfg) / (layout.tp * layout.pp) * (shards - 1) / shards
        comm = tp_bytes / self.tp_bandwidth + dp_bytes / self.dp_bandwidth
        comm += m * cfg.num_layers / layout.pp * self.ring_seconds_per_layer(cfg, layout, mbs, seq)
        return self.compute_scale * compute * (1 + bubble) + self.comm_scale * comm

    def ring_seconds_per_layer(self, cfg: GPTConfig, layout: Layout, mbs: int, seq: int) -> float:
        """Exposed time of one layer's ring exchanges for one micro batch (0 without cp). Each
        of the cp - 1 forward steps sends this rank's keys and values (bf16) to the next rank
        while the attention of the step's block runs; the backward sends each received
        block's key/value gradients (bf16) home beside the next block's backward (ring.py).
        What the attention does not cover counts, and the merges of the blocks."""
        cp = layout.cp
        if cp == 1:
            return 0.0
        if cfg.cp_comm_type == "a2a":  # q, k, v out and the output back, twice (fwd + bwd)
            heads = cfg.num_attention_heads + 2 * cfg.query_groups
            local = (seq // cp) * mbs * cfg.head_dim * heads // layout.tp  # elements
            return 2 * 2 * 2 * local * (cp - 1) / cp / self.cp_bandwidth
        kv = 2 * (seq // cp) * mbs * cfg.head_dim * cfg.query_groups // layout.tp  # elements
        # causal: half the scores of attention_flops; a third forward, two thirds backward;
        # each rank's share of every ring step is 1 / (tp * cp * cp) of the layer's attention
        per_step = attention_flops(cfg, mbs, seq) / 2 / cfg.num_layers / (layout.tp * cp * cp)
        step_time = per_step / (self.peak_flops * self.efficiency)
        fwd = (cp - 1) * max(0.0, 2 * kv / self.cp_bandwidth - step_time / 3)
        bwd = (cp - 1) * max(0.0, 2 * kv / self.cp_bandwidth - 2 * step_time / 3)
        # each later ring step merges into the output and adds into the gradients, in fp32:
        # about 64 bytes per local token and hidden element (0.6 ms a layer for 16k tokens of
        # hidden 2048 on an H200, BENCHMARKS.md's cp 2 profiles)
        merges = (cp - 1) * 64 * (seq // cp) * mbs * cfg.hidden_size / layout.tp
        return fwd + bwd + merges / self.memory_bandwidth

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
        cp_sizes: tuple[int, ...] = (1, 2, 4, 8),
        pp_sizes: tuple[int, ...] | None = None,
    ):
        self.cfg, self.gbs, self.seq = cfg, global_batch_size, seq_length
        self.gpu_memory_gib, self.distopt = gpu_memory_gib, distributed_optimizer
        self.cost = cost or CostModel()
        self.micro_batch_sizes, self.recomputes = micro_batch_sizes, recomputes
        self.cp_sizes = cp_sizes
        """Context-parallel degrees to consider ((1,) where the job's features exclude cp)."""
        self.pp_sizes = pp_sizes
        """Pipeline degrees to consider (None: every divisor; (1,) for variable shapes)."""

    def _degrees(self, num_members: int):
        """(tp, cp, pp, dp) that fill `num_members` ranks."""
        for tp in (t for t in (1, 2, 4, 8) if num_members % t == 0):
            for cp in (c for c in self.cp_sizes if (num_members // tp) % c == 0):
                rest = num_members // (tp * cp)
                pps = self.pp_sizes or range(1, rest + 1)
                for pp in (p for p in pps if rest % p == 0):
                    yield tp, cp, pp, rest // pp

    def _layouts(self, num_members: int):
        """Every layout of `num_members` ranks: degrees, virtual stages, sequence parallelism."""
        for tp, cp, pp, dp in self._degrees(num_members):
            for vpp in (1, 2) if pp > 1 else (1,):
                for sp in (False, True) if tp > 1 else (False,):
                    yield Layout(tp=tp, pp=pp, dp=dp, vpp=vpp, sequence_parallel=sp, cp=cp)

    def candidates(self, num_members: int):
        cfg = self.cfg
        recomputes = self.recomputes or (
            RecomputeConfig(),
            RecomputeConfig("selective"),
            RecomputeConfig("full", "uniform", 1),
        )
        for layout in self._layouts(num_members):
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
                    check_cp_heads(cfg, layout)
                except LayoutError:
                    continue
                if layout.vpp > 1 and (self.gbs // (mbs * layout.dp)) % layout.pp:
                    continue
                for rc in recomputes:
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
