"""The state description of GPT weights: one table of how each global weight is split.

Every weight has a global name and a global shape that do not depend on the layout. A layout
says which rectangular piece of which global weight each rank holds:

    specs = param_specs(cfg)                          # name -> ParamSpec (global, layout-free)
    names = chunk_param_names(cfg, layout, pp_rank, chunk)
    piece = tp_piece(specs[name], cfg, tp, tp_rank)   # the region this tp rank holds
    local = piece.take(global_tensor)                 # and its local tensor

Initialization, checkpoints, resharding and conversion all read this one table.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from megadyn.core.layout import Layout, chunk_layer_range
from megadyn.core.tensor_parallel.layers import vocab_range
from megadyn.models.config import GPTConfig


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    """Global shape."""
    split_dim: int | None
    """Dimension of `view` split evenly over tp; None when replicated."""
    view: tuple[int, ...] | None = None
    """Global tensor viewed as this shape for splitting (SwiGLU: [2, ffn, h], split dim 1)."""
    vocab: bool = False
    """Split along dim 0 by `vocab_range` (uneven, padding rows never stored)."""
    init: str = "normal"
    """'normal', 'scaled_normal' (output projections), 'zeros' or 'ones'."""


@dataclass(frozen=True)
class Piece:
    """The region of a global tensor (in its split view) that one rank holds."""

    spec: ParamSpec
    view_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.sizes))

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the local tensor (the view's piece, un-viewed)."""
        if self.spec.view is None:
            return self.sizes
        shape = list(self.spec.shape)
        d = self.spec.split_dim
        shape[0] = shape[0] * self.sizes[d] // self.view_shape[d]  # view splits a factor of dim 0
        return tuple(shape)

    def take(self, global_tensor: torch.Tensor) -> torch.Tensor:
        region = global_tensor.view(self.view_shape)[self.slices]
        return region.reshape(self.local_shape)

    def put(self, global_tensor: torch.Tensor, local: torch.Tensor) -> None:
        global_tensor.view(self.view_shape)[self.slices].copy_(local.reshape(self.sizes))


def _layer_specs(cfg: GPTConfig, i: int) -> list[ParamSpec]:
    h, d, ffn = cfg.hidden_size, cfg.head_dim, cfg.ffn_size
    qkv = cfg.query_groups * (cfg.num_attention_heads // cfg.query_groups + 2) * d
    p = f"decoder.layers.{i}."
    fc1 = 2 * ffn if cfg.activation == "swiglu" else ffn
    fc1_view = (2, ffn) if cfg.activation == "swiglu" else None
    fc1_dim = 1 if fc1_view else 0
    specs = []
    for norm in ("input_layernorm", "pre_mlp_layernorm"):
        specs.append(ParamSpec(p + norm + ".weight", (h,), None, init="ones"))
        if cfg.normalization == "LayerNorm":
            specs.append(ParamSpec(p + norm + ".bias", (h,), None, init="zeros"))
    specs += [
        ParamSpec(p + "self_attention.linear_qkv.weight", (qkv, h), 0),
        ParamSpec(p + "self_attention.linear_proj.weight", (h, h), 1, init="scaled_normal"),
        ParamSpec(p + "mlp.linear_fc1.weight", (fc1, h), fc1_dim, view=fc1_view and (2, ffn, h)),
        ParamSpec(p + "mlp.linear_fc2.weight", (h, ffn), 1, init="scaled_normal"),
    ]
    if cfg.add_bias_linear:
        specs += [
            ParamSpec(p + "self_attention.linear_qkv.bias", (qkv,), 0, init="zeros"),
            ParamSpec(p + "self_attention.linear_proj.bias", (h,), None, init="zeros"),
            ParamSpec(p + "mlp.linear_fc1.bias", (fc1,), fc1_dim, view=fc1_view, init="zeros"),
            ParamSpec(p + "mlp.linear_fc2.bias", (h,), None, init="zeros"),
        ]
    return specs


def embedding_specs(cfg: GPTConfig) -> list[ParamSpec]:
    specs = [
        ParamSpec(
            "embedding.word_embeddings.weight", (cfg.vocab_size, cfg.hidden_size), 0, vocab=True
        )
    ]
    if cfg.position_embedding_type == "learned_absolute":
        specs.append(
            ParamSpec(
                "embedding.position_embeddings.weight",
                (cfg.max_position_embeddings, cfg.hidden_size),
                None,
            )
        )
    return specs


def head_specs(cfg: GPTConfig) -> list[ParamSpec]:
    h = cfg.hidden_size
    specs = [ParamSpec("decoder.final_layernorm.weight", (h,), None, init="ones")]
    if cfg.normalization == "LayerNorm":
        specs.append(ParamSpec("decoder.final_layernorm.bias", (h,), None, init="zeros"))
    if cfg.untie_embeddings_and_output_weights:
        specs.append(ParamSpec("output_layer.weight", (cfg.vocab_size, h), 0, vocab=True))
    return specs


def param_specs(cfg: GPTConfig) -> dict[str, ParamSpec]:
    """Every global weight of the model, by name, in model order."""
    specs = embedding_specs(cfg)
    for i in range(cfg.num_layers):
        specs += _layer_specs(cfg, i)
    specs += head_specs(cfg)
    return {s.name: s for s in specs}


def num_params(cfg: GPTConfig) -> int:
    """Weights of the model, each global weight counted once (a tied output layer is the
    embedding; vocabulary padding is not counted)."""
    return sum(math.prod(spec.shape) for spec in param_specs(cfg).values())


def chunk_param_names(cfg: GPTConfig, layout: Layout, pp_rank: int, chunk: int) -> list[str]:
    """Global names of the weights held by virtual chunk `chunk` of pipeline rank `pp_rank`."""
    first = pp_rank == 0 and chunk == 0
    last = pp_rank == layout.pp - 1 and chunk == layout.vpp - 1
    names = []
    if first:
        names += [s.name for s in embedding_specs(cfg)]
    elif last and not cfg.untie_embeddings_and_output_weights:
        names.append("embedding.word_embeddings.weight")  # tied output weight, kept in sync
    for i in chunk_layer_range(layout, cfg.num_layers, pp_rank, chunk):
        names += [s.name for s in _layer_specs(cfg, i)]
    if last:
        names += [s.name for s in head_specs(cfg)]
    return names


def tp_piece(spec: ParamSpec, cfg: GPTConfig, tp: int, tp_rank: int) -> Piece:
    """The region of `spec`'s global tensor that tensor-parallel rank `tp_rank` of `tp` holds."""
    view = spec.view or spec.shape
    offsets, sizes = [0] * len(view), list(view)
    if spec.vocab:
        start, end = vocab_range(spec.shape[0], cfg.padded_vocab_size(tp), tp_rank, tp)
        offsets[0], sizes[0] = start, end - start
    elif spec.split_dim is not None:
        d = spec.split_dim
        if view[d] % tp:
            raise ValueError(f"{spec.name}: dim {d} of {view} is not divisible by tp {tp}")
        sizes[d] = view[d] // tp
        offsets[d] = tp_rank * sizes[d]
    return Piece(spec, tuple(view), tuple(offsets), tuple(sizes))


def init_global(spec: ParamSpec, cfg: GPTConfig, seed: int, device=None) -> torch.Tensor:
    """The global initial value of one weight: a function of (seed, name) only."""
    out = torch.empty(spec.shape, dtype=torch.float32, device=device)
    if spec.init == "zeros":
        return out.zero_()
    if spec.init == "ones":
        return out.fill_(1.0)
    std = cfg.init_method_std
    if spec.init == "scaled_normal":
        std = std / (2.0 * cfg.num_layers) ** 0.5
    gen = torch.Generator(device=out.device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(spec.name.encode())) % (2**63))
    return out.normal_(0.0, std, generator=gen)
