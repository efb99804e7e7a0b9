"""Hugging Face GPT-2 / Llama weight names and layouts <-> megadyn's global weights.

    rules = weight_rules(cfg, "GPT")                  # one Rule per megadyn weight
    hf_shapes = expected_hf_shapes(cfg, "GPT")        # {hf name: shape}, for checking input
    tensor = rule.to_megadyn([hf tensors...])         # at the global shape of sharding.py
    hf_tensors = rule.to_hf(tensor)                   # inverse: exact (only permutations)

megadyn's fused QKV is laid out per query group, [ng, (np/ng + 2) * d, h]: the group's
queries, then its key, then its value. HF GPT-2's `c_attn` is a Conv1D, weight [in, out] =
[h, q;k;v], and Llama keeps q/k/v apart; both are re-laid here. SwiGLU's fc1 is [gate; up].
Every transform is a permutation, so a round trip gives back identical tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megadyn.models.config import GPTConfig
from megadyn.models.sharding import param_specs

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class Rule:
    """How one megadyn weight is made from HF tensors `hf` (and back)."""

    name: str
    hf: tuple[str, ...]
    to_megadyn: Callable[[Tensors], torch.Tensor]
    to_hf: Callable[[torch.Tensor], Tensors]


def _same(ts: Tensors) -> torch.Tensor:
    return ts[0]


def _same_back(t: torch.Tensor) -> Tensors:
    return [t]


def _conv1d(ts: Tensors) -> torch.Tensor:
    return ts[0].t()  # Conv1D [in, out] -> Linear [out, in]


def _conv1d_back(t: torch.Tensor) -> Tensors:
    return [t.t()]


def interleave_qkv(cfg: GPTConfig, q, k, v) -> torch.Tensor:
    """[np*d, ...], [ng*d, ...], [ng*d, ...] -> megadyn's [ng * (np/ng + 2) * d, ...]."""
    ng, d, rest = cfg.query_groups, cfg.head_dim, q.shape[1:]
    qpg = cfg.num_attention_heads // ng
    grouped = torch.cat(
        [q.reshape(ng, qpg * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], dim=1
    )  # [ng, (qpg + 2) * d, ...]
    return grouped.reshape(-1, *rest)


def split_qkv(cfg: GPTConfig, qkv: torch.Tensor) -> Tensors:
    """Inverse of `interleave_qkv`: [q, k, v] with heads in HF order."""
    ng, d, rest = cfg.query_groups, cfg.head_dim, qkv.shape[1:]
    qpg = cfg.num_attention_heads // ng
    grouped = qkv.reshape(ng, (qpg + 2) * d, *rest)
    q, k, v = grouped.split([qpg * d, d, d], dim=1)
    return [t.reshape(-1, *rest) for t in (q, k, v)]


def _gpt2_rules(cfg: GPTConfig) -> list[Rule]:
    def qkv_weight(ts):  # c_attn [h, 3h] -> [3h, h] = [q; k; v] -> per head
        return interleave_qkv(cfg, *ts[0].t().chunk(3, dim=0))

    def qkv_weight_back(t):
        return [torch.cat(split_qkv(cfg, t), dim=0).t()]

    def qkv_bias(ts):
        return interleave_qkv(cfg, *ts[0].chunk(3, dim=0))

    def qkv_bias_back(t):
        return [torch.cat(split_qkv(cfg, t), dim=0)]

    rules = [
        Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",), _same, _same_back),
        Rule(
            "embedding.position_embeddings.weight",
            ("transformer.wpe.weight",),
            _same,
            _same_back,
        ),
    ]
    for i in range(cfg.num_layers):
        p, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            for kind in ("weight", "bias"):
                rules.append(Rule(f"{p}{ours}.{kind}", (f"{h}{theirs}.{kind}",), _same, _same_back))
        rules += [
            Rule(
                p + "self_attention.linear_qkv.weight",
                (h + "attn.c_attn.weight",),
                qkv_weight,
                qkv_weight_back,
            ),
            Rule(
                p + "self_attention.linear_qkv.bias",
                (h + "attn.c_attn.bias",),
                qkv_bias,
                qkv_bias_back,
            ),
        ]
        for ours, theirs in (
            ("self_attention.linear_proj", "attn.c_proj"),
            ("mlp.linear_fc1", "mlp.c_fc"),
            ("mlp.linear_fc2", "mlp.c_proj"),
        ):
            rules.append(Rule(f"{p}{ours}.weight", (f"{h}{theirs}.weight",), _conv1d, _conv1d_back))
            rules.append(Rule(f"{p}{ours}.bias", (f"{h}{theirs}.bias",), _same, _same_back))
    rules += [
        Rule("decoder.final_layernorm.weight", ("transformer.ln_f.weight",), _same, _same_back),
        Rule("decoder.final_layernorm.bias", ("transformer.ln_f.bias",), _same, _same_back),
    ]
    if cfg.untie_embeddings_and_output_weights:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), _same, _same_back))
    return rules


def _llama_rules(cfg: GPTConfig) -> list[Rule]:
    def qkv(ts):
        return interleave_qkv(cfg, *ts)

    def qkv_back(t):
        return split_qkv(cfg, t)

    def fc1(ts):  # [gate; up]
        return torch.cat(ts, dim=0)

    def fc1_back(t):
        return list(t.chunk(2, dim=0))

    kinds = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
    rules = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), _same, _same_back)
    ]
    for i in range(cfg.num_layers):
        p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        rules.append(
            Rule(p + "input_layernorm.weight", (h + "input_layernorm.weight",), _same, _same_back)
        )
        rules.append(
            Rule(
                p + "pre_mlp_layernorm.weight",
                (h + "post_attention_layernorm.weight",),
                _same,
                _same_back,
            )
        )
        for kind in kinds:
            attn = tuple(f"{h}self_attn.{x}_proj.{kind}" for x in "qkv")
            mlp = (f"{h}mlp.gate_proj.{kind}", f"{h}mlp.up_proj.{kind}")
            rules += [
                Rule(f"{p}self_attention.linear_qkv.{kind}", attn, qkv, qkv_back),
                Rule(
                    f"{p}self_attention.linear_proj.{kind}",
                    (f"{h}self_attn.o_proj.{kind}",),
                    _same,
                    _same_back,
                ),
                Rule(f"{p}mlp.linear_fc1.{kind}", mlp, fc1, fc1_back),
                Rule(f"{p}mlp.linear_fc2.{kind}", (f"{h}mlp.down_proj.{kind}",), _same, _same_back),
            ]
    rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), _same, _same_back))
    if cfg.untie_embeddings_and_output_weights:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), _same, _same_back))
    return rules


def weight_rules(cfg: GPTConfig, family: str) -> list[Rule]:
    """One rule per weight of `param_specs(cfg)`, in model order."""
    rules = _gpt2_rules(cfg) if family == "GPT" else _llama_rules(cfg)
    assert sorted(r.name for r in rules) == sorted(param_specs(cfg)), "rules miss a weight"
    return rules


def expected_hf_shapes(cfg: GPTConfig, family: str) -> dict[str, tuple[int, ...]]:
    """The HF tensors (name -> shape) that `cfg` needs, from the rules run on meta tensors."""
    specs = param_specs(cfg)
    shapes = {}
    for rule in weight_rules(cfg, family):
        meta = torch.empty(specs[rule.name].shape, device="meta")
        for name, t in zip(rule.hf, rule.to_hf(meta)):
            shapes[name] = tuple(t.shape)
    return shapes


HF_PREFIXES = {"GPT": "transformer.", "llama": "model."}
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
"""Buffers that older transformers versions saved with the weights (not weights)."""


def canonical_hf_name(name: str, family: str) -> str:
    """HF names as GPT2LMHeadModel / LlamaForCausalLM hold them: files saved from the base
    model (GPT2Model, as the original `gpt2` repository) lack the `transformer.` prefix."""
    prefix = HF_PREFIXES[family]
    if name.startswith(prefix) or name.startswith("lm_head."):
        return name
    return prefix + name


def is_ignored(name: str, cfg: GPTConfig) -> bool:
    """Saved tensors that are not weights of the model: old buffers, a tied lm_head copy."""
    if name.endswith(IGNORED_SUFFIXES):
        return True
    return name == "lm_head.weight" and not cfg.untie_embeddings_and_output_weights
