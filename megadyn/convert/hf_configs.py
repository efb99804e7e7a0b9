"""Hugging Face `config.json` <-> megadyn's GPTConfig, for GPT-2 and Llama.

    family = hf_family(hf, "gpt2-dir/config.json")       # "GPT" or "llama"
    cfg = config_from_hf(hf, family, "gpt2-dir/config.json")
    hf = config_to_hf(cfg, family_of(cfg), torch.float32, special_tokens={"eos_token_id": 2})

A config.json written by `save_pretrained` omits fields at their default, so the defaults of
transformers' GPT2Config and LlamaConfig are repeated here (no transformers import is needed to
convert). Anything megadyn's model cannot compute exactly (rope scaling, a head_dim other than
hidden/heads, an activation other than GeLU/SiLU) is refused with the field's name.
"""

from __future__ import annotations

from typing import Any

import torch

from megadyn.convert.errors import ConversionError
from megadyn.models.config import GPTConfig

FAMILIES = ("GPT", "llama")
"""--model-type values: the GPT-2 block and the Llama block."""
ARCHITECTURES = {"GPT2LMHeadModel": "GPT", "LlamaForCausalLM": "llama"}
MODEL_TYPES = {"gpt2": "GPT", "llama": "llama"}

GPT2_DEFAULTS = dict(
    vocab_size=50257,
    n_positions=1024,
    n_embd=768,
    n_layer=12,
    n_head=12,
    n_inner=None,
    activation_function="gelu_new",
    resid_pdrop=0.1,
    attn_pdrop=0.1,
    layer_norm_epsilon=1e-5,
    initializer_range=0.02,
    scale_attn_weights=True,
    scale_attn_by_inverse_layer_idx=False,
    add_cross_attention=False,
    tie_word_embeddings=True,
)
LLAMA_DEFAULTS = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=None,
    head_dim=None,
    hidden_act="silu",
    max_position_embeddings=2048,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
    attention_dropout=0.0,
)
GELUS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}
"""HF activation_function -> megadyn's openai_gelu (tanh approximation)."""
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_family(hf: dict[str, Any], source: str) -> str:
    """ "GPT" or "llama" from `architectures` / `model_type`; ConversionError for anything else."""
    archs = hf.get("architectures") or []
    known = {ARCHITECTURES[a] for a in archs if a in ARCHITECTURES}
    model_type = hf.get("model_type")
    if not known and not archs and model_type in MODEL_TYPES:
        known = {MODEL_TYPES[model_type]}
    if len(known) != 1:
        raise ConversionError(
            f"{source}: architecture {archs or None} (model_type {model_type!r}) is not supported; "
            f"--loader hf reads {', '.join(ARCHITECTURES)}"
        )
    return known.pop()


def _get(hf: dict, defaults: dict, key: str) -> Any:
    value = hf.get(key, defaults[key])
    return defaults[key] if value is None and defaults[key] is not None else value


def _rope_theta(hf: dict, source: str) -> float:
    """Base frequency from transformers 5's `rope_parameters` or 4's `rope_theta`/`rope_scaling`."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for where, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise ConversionError(
                f"{source}: {where} rope_type {kind!r} is not supported (megadyn's RoPE is the "
                "default, unscaled one)"
            )
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def config_from_hf(hf: dict[str, Any], family: str, source: str) -> GPTConfig:
    """The GPTConfig that computes the same function as the HF model of `hf`."""
    if family == "GPT":
        return _gpt2_from_hf(hf, source)
    return _llama_from_hf(hf, source)


def _gpt2_from_hf(hf: dict, source: str) -> GPTConfig:
    g = lambda key: _get(hf, GPT2_DEFAULTS, key)  # noqa: E731
    act = g("activation_function")
    if act not in GELUS:
        raise ConversionError(
            f"{source}: activation_function {act!r} is not supported (one of {sorted(GELUS)})"
        )
    for key, want in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if g(key) != want:
            raise ConversionError(f"{source}: {key} = {g(key)!r} is not supported (needs {want})")
    return GPTConfig.gpt2(
        num_layers=g("n_layer"),
        hidden_size=g("n_embd"),
        num_attention_heads=g("n_head"),
        ffn_hidden_size=g("n_inner") or 4 * g("n_embd"),
        vocab_size=g("vocab_size"),
        max_position_embeddings=g("n_positions"),
        norm_epsilon=g("layer_norm_epsilon"),
        openai_gelu=GELUS[act],
        untie_embeddings_and_output_weights=not g("tie_word_embeddings"),
        hidden_dropout=g("resid_pdrop"),
        attention_dropout=g("attn_pdrop"),
        init_method_std=g("initializer_range"),
    )


def _llama_from_hf(hf: dict, source: str) -> GPTConfig:
    g = lambda key: _get(hf, LLAMA_DEFAULTS, key)  # noqa: E731
    heads, hidden = g("num_attention_heads"), g("hidden_size")
    if g("hidden_act") != "silu":
        raise ConversionError(f"{source}: hidden_act {g('hidden_act')!r} is not supported (silu)")
    if g("head_dim") not in (None, hidden // heads):
        raise ConversionError(
            f"{source}: head_dim {g('head_dim')} is not hidden_size / num_attention_heads "
            f"({hidden // heads}), which megadyn's attention assumes"
        )
    if g("attention_bias") != g("mlp_bias"):
        raise ConversionError(
            f"{source}: attention_bias ({g('attention_bias')}) and mlp_bias ({g('mlp_bias')}) "
            "differ; megadyn has one switch for all linear biases (--disable-bias-linear)"
        )
    kv = g("num_key_value_heads") or heads
    return GPTConfig.llama(
        num_layers=g("num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=kv if kv != heads else None,
        ffn_hidden_size=g("intermediate_size"),
        vocab_size=g("vocab_size"),
        max_position_embeddings=g("max_position_embeddings"),
        rotary_base=_rope_theta(hf, source),
        norm_epsilon=g("rms_norm_eps"),
        add_bias_linear=bool(g("attention_bias")),
        untie_embeddings_and_output_weights=not g("tie_word_embeddings"),
        hidden_dropout=0.0,
        attention_dropout=g("attention_dropout"),
        init_method_std=g("initializer_range"),
    )


def family_of(cfg: GPTConfig, source: str) -> str:
    """The HF architecture that computes `cfg`'s function, or ConversionError naming the field."""
    family = "llama" if cfg.position_embedding_type == "rope" else "GPT"
    need = {
        "GPT": dict(
            normalization="LayerNorm",
            activation="gelu",
            add_bias_linear=True,
            query_groups=cfg.num_attention_heads,
        ),
        "llama": dict(normalization="RMSNorm", activation="swiglu"),
    }[family]
    for key, want in need.items():
        if getattr(cfg, key) != want:
            arch = "GPT2LMHeadModel" if family == "GPT" else "LlamaForCausalLM"
            raise ConversionError(
                f"{source}: model.{key} = {getattr(cfg, key)!r} has no {arch} equivalent "
                f"(needs {want!r} with position_embedding_type {cfg.position_embedding_type!r})"
            )
    if family == "llama" and cfg.openai_gelu:
        raise ConversionError(f"{source}: model.openai_gelu has no meaning for a SwiGLU model")
    return family


def config_to_hf(
    cfg: GPTConfig, family: str, dtype: torch.dtype, special_tokens: dict[str, int | None]
) -> dict[str, Any]:
    """config.json of the HF model equal to `cfg` (keys of transformers 4 and 5 both)."""
    common = dict(
        vocab_size=cfg.vocab_size,
        initializer_range=cfg.init_method_std,
        tie_word_embeddings=not cfg.untie_embeddings_and_output_weights,
        use_cache=True,
        dtype=DTYPE_NAMES[dtype],
        torch_dtype=DTYPE_NAMES[dtype],
        **special_tokens,
    )
    if family == "GPT":
        return dict(
            architectures=["GPT2LMHeadModel"],
            model_type="gpt2",
            n_positions=cfg.max_position_embeddings,
            n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers,
            n_head=cfg.num_attention_heads,
            n_inner=cfg.ffn_size,
            activation_function="gelu_new" if cfg.openai_gelu else "gelu",
            layer_norm_epsilon=cfg.norm_epsilon,
            resid_pdrop=cfg.hidden_dropout,
            embd_pdrop=cfg.hidden_dropout,
            attn_pdrop=cfg.attention_dropout,
            scale_attn_weights=True,
            **common,
        )
    return dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.query_groups,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_epsilon,
        rope_theta=cfg.rotary_base,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base},
        attention_bias=cfg.add_bias_linear,
        mlp_bias=cfg.add_bias_linear,
        attention_dropout=cfg.attention_dropout,
        **common,
    )
