"""The full training-state description: which rank holds which piece of which global tensor.

    desc = describe(cfg, layout, members, distopt=DistOpt(bucket_size=None))
    desc.tensors["optim.decoder.layers.0.mlp.linear_fc1.weight.exp_avg"]   # global view, dtype
    desc.pieces[rank]            # [HeldPiece], at most one per key and rank

Keys (global names, the same as the checkpoint's, DESIGN section 3):
    model.<name>                             weight, model dtype, tp piece of its split view
    optim.<name>.main|exp_avg|exp_avg_sq     fp32; without the distributed optimizer the same
                                             pieces as the weight (replicated over dp and
                                             cp); with it the flat range of the tp/pp-local
                                             piece that `plan_buckets` gives this rank among
                                             the ranks of its optimizer instance (all dp x cp
                                             ranks holding the weight, or 1/N of them under
                                             `layout.distopt_instances` N: the rank at the
                                             same place in each other instance holds the
                                             same range, a replica the planner may read)
    scalar.*                                 small replicated tensors a caller names (`scalars`);
                                             the job's layout-free scalars (progress, schedule,
                                             loss scale) travel as megadyn/training/state.py's
                                             TrainingState instead, one path for every use

Split rules come from `megadyn.models.sharding` only; the bucket layout of the distributed
optimizer from `plan_buckets` over the chunk's params in module registration order.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from megadyn.core.distributed.param_and_grad_buffer import plan_buckets
from megadyn.core.layout import Coords, Layout, RankGrid
from megadyn.models.config import GPTConfig
from megadyn.models.gpt import GPTModel
from megadyn.models.sharding import chunk_param_names, param_specs, tp_piece

OPTIM_KEYS = ("main", "exp_avg", "exp_avg_sq")
WORD_EMBEDDING = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class DistOpt:
    """The distributed optimizer (ZeRO-1) is on, with this DDP bucket size (elements)."""

    bucket_size: int | None = None
    """`DistributedDataParallel.bucket_size` (None: one bucket per chunk)."""


@dataclass(frozen=True)
class TensorInfo:
    """A global tensor of training state."""

    shape: tuple[int, ...]
    """Global shape of its split view (SwiGLU fc1: [2, ffn, h])."""
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True)
class HeldPiece:
    """Elements [start, end) of the row-major flattening of box (offsets, sizes) of a key."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int
    end: int
    local_shape: tuple[int, ...]
    """Shape of the tensor a rank keeps for it (flat [end - start] for optimizer shards)."""

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class StateDescription:
    """Global tensors and, per member rank, the pieces it holds."""

    tensors: dict[str, TensorInfo]
    pieces: dict[int, list[HeldPiece]]

    def held(self, rank: int) -> dict[str, HeldPiece]:
        return {p.key: p for p in self.pieces.get(rank, [])}

    def replicas(self, rank: int) -> dict[str, list[int]]:
        """Per key that `rank` holds, the other ranks holding the same piece (data-parallel
        copies of a weight, other instances' copies of an optimizer shard): where its state
        can be read from when `rank` is gone. An empty list: `rank` holds the only copy."""
        holders: dict[HeldPiece, list[int]] = {}
        for other, pieces in self.pieces.items():
            for p in pieces:
                holders.setdefault(p, []).append(other)
        return {p.key: [r for r in holders[p] if r != rank] for p in self.pieces.get(rank, [])}


@lru_cache(maxsize=16)
def _registration_order(cfg: GPTConfig) -> dict[str, int]:
    """Position of each param of a tiny one-layer model of `cfg`'s structure in
    `named_parameters()` (CPU: the meta device's init would import torch._dynamo, 2 s)."""
    tiny = cfg.with_(
        num_layers=1,
        hidden_size=cfg.num_attention_heads,
        ffn_hidden_size=1,
        vocab_size=1,
        make_vocab_size_divisible_by=1,
        max_position_embeddings=1,
    )
    with torch.random.fork_rng(devices=[]):  # module constructors draw random numbers
        model = GPTModel(tiny, layer_range=range(1))
    return {name: i for i, (name, _) in enumerate(model.named_parameters())}


def registration_order(cfg: GPTConfig, names: Sequence[str]) -> list[str]:
    """`names` of one chunk sorted as the chunk registers them (what DDP buffers follow)."""
    order = _registration_order(cfg)
    first_layer = min(i for n, i in order.items() if n.startswith("decoder.layers.0."))

    def key(name: str) -> tuple[int, int, int]:
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        if m:
            return first_layer, int(m[1]), order["decoder.layers.0." + m[2]]
        return order[name], 0, 0

    return sorted(names, key=key)


def flat_ranges(
    numels: list[int], dp: int, distopt: DistOpt, separate: list[bool]
) -> list[list[tuple[int, int]]]:
    """Per param, per rank of the `dp` ranks sharing the optimizer (dp x cp), the flat range
    [start, end) of the param it owns."""
    ranges, buckets = plan_buckets(
        numels,
        dp_size=dp,
        bucket_size=distopt.bucket_size,
        use_distributed_optimizer=True,
        separate=separate,
    )
    out = []
    for p_start, p_end, b in ranges:
        b_start, b_end = buckets[b]
        size = (b_end - b_start) // dp
        per_rank = []
        for r in range(dp):
            lo, hi = max(p_start, b_start + r * size), min(p_end, b_start + (r + 1) * size)
            per_rank.append((lo - p_start, hi - p_start) if lo < hi else (0, 0))
        out.append(per_rank)
    return out


def describe(
    cfg: GPTConfig,
    layout: Layout,
    members: Sequence[int],
    *,
    distopt: DistOpt | bool | None = None,
    scalars: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
) -> StateDescription:
    """The pieces of every global tensor that each member of `layout` holds."""
    scalars = scalars or {}
    distopt = DistOpt() if distopt is True else (distopt or None)
    grid = RankGrid(layout, tuple(members))
    specs = param_specs(cfg)
    tensors: dict[str, TensorInfo] = {}
    for name, spec in specs.items():
        view = tuple(spec.view or spec.shape)
        tensors[f"model.{name}"] = TensorInfo(view, cfg.params_dtype)
        for k in OPTIM_KEYS:
            tensors[f"optim.{name}.{k}"] = TensorInfo(view, torch.float32)
    for key, (shape, dtype) in scalars.items():
        tensors[key] = TensorInfo(tuple(shape), dtype)

    pieces: dict[int, list[HeldPiece]] = {r: [] for r in grid.members}
    per_instance = layout.dp * layout.cp // layout.distopt_instances  # ranks sharing one copy
    tied = not cfg.untie_embeddings_and_output_weights
    for p in range(layout.pp):
        for c in range(layout.vpp):
            names = registration_order(cfg, chunk_param_names(cfg, layout, p, c))
            for t in range(layout.tp):
                tp_pieces = [tp_piece(specs[n], cfg, layout.tp, t) for n in names]
                flat = None
                if distopt is not None:
                    numels = [math.prod(x.sizes) for x in tp_pieces]
                    separate = [tied and n == WORD_EMBEDDING for n in names]
                    flat = flat_ranges(numels, per_instance, distopt, separate)
                for shard in range(layout.dp * layout.cp):  # dp x cp ranks, cp fastest
                    coords = Coords(tp=t, dp=shard // layout.cp, pp=p, cp=shard % layout.cp)
                    held = pieces[grid.rank_of(coords)]
                    for i, (name, piece) in enumerate(zip(names, tp_pieces)):
                        numel = math.prod(piece.sizes)
                        box = (piece.offsets, piece.sizes)
                        held.append(HeldPiece(f"model.{name}", *box, 0, numel, piece.local_shape))
                        start, end = (0, numel) if flat is None else flat[i][shard % per_instance]
                        if flat is not None and start == end:
                            continue  # this rank owns no part of the param's optimizer state
                        shape = piece.local_shape if flat is None else (end - start,)
                        for k in OPTIM_KEYS:
                            held.append(HeldPiece(f"optim.{name}.{k}", *box, start, end, shape))
    for rank in grid.members:
        for key, (shape, _) in scalars.items():
            shape = tuple(shape)
            pieces[rank].append(
                HeldPiece(key, (0,) * len(shape), shape, 0, math.prod(shape), shape)
            )
    return StateDescription(tensors, pieces)
