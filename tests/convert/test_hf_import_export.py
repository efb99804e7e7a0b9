"""Hugging Face GPT-2 and Llama into megadyn and back.

Imported once, each model is loaded by `load_checkpoint` under tp in {1, 2} x pp in {1, 2}
(spawned processes; hidden states passed between stages) and its logits equal transformers'
within 1e-4; exported back, every tensor is identical to the original's.
"""

import os

import pytest
import torch
import torch.distributed as dist
from convert_helpers import (
    assert_same_state,
    export_args,
    hf_logits,
    hf_model,
    import_args,
    tokens,
    tool,
)

from megadyn.testing import spawn

FAMILIES = ["GPT", "llama"]
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{family: (HF model, its directory, the megadyn checkpoint)}."""
    out = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(family)
        model = hf_model(family)
        model.save_pretrained(root / "hf")
        tool("convert_checkpoint").main(import_args(str(root / "hf"), str(root / "ckpt")))
        out[family] = (model, str(root / "hf"), str(root / "ckpt"))
    return out


def forward_under_layout(rank, world, ckpts, tp, pp, ids):
    """Load each checkpoint under (tp, pp) and run the pipeline forward; the last stage returns
    its vocabulary slice of the logits [s, b, V/tp] per checkpoint."""
    from megadyn.convert.megadyn_files import open_checkpoint
    from megadyn.core.groups import ParallelGroups
    from megadyn.core.layout import Layout
    from megadyn.models import build_gpt_chunks
    from megadyn.training.checkpoint import load_checkpoint

    groups = ParallelGroups.build(Layout(tp=tp, pp=pp), members=range(world))
    out = {}
    for family, ckpt in ckpts.items():
        cfg = open_checkpoint(ckpt).cfg
        chunks = build_gpt_chunks(cfg, groups)
        meta = load_checkpoint(ckpt, chunks, None, groups, load_rng=False)
        assert not meta["optim_restored"]
        chunk = chunks[0].eval()
        with torch.no_grad():
            if groups.is_first_stage:
                x = chunk(tokens=ids)  # [s, b, h], or the logits with pp 1
            else:
                x = torch.empty(ids.shape[1], ids.shape[0], cfg.hidden_size)  # [s, b, h]
                dist.recv(x, src=groups.pp_neighbor(-1))
                x = chunk(hidden_states=x)
            if groups.is_last_stage:
                out[family] = x
            else:
                dist.send(x.contiguous(), dst=groups.pp_neighbor(1))
    return out


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
def test_logits_equal_transformers_under_layout(converted, tp, pp):
    ids = tokens()
    ckpts = {family: ckpt for family, (_, _, ckpt) in converted.items()}
    results = spawn(forward_under_layout, world=tp * pp, args=(ckpts, tp, pp, ids))
    for family, (model, _, _) in converted.items():
        pieces = [r[family] for r in results if family in r]  # last stage, in tp-rank order
        assert len(pieces) == tp
        logits = torch.cat(pieces, dim=-1).transpose(0, 1)  # [b, s, V]
        torch.testing.assert_close(
            logits,
            hf_logits(model, ids),
            rtol=0,
            atol=1e-4,
            msg=lambda m, family=family: f"{family}: {m}",
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_gives_identical_tensors(converted, family, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model, hf_dir, ckpt = converted[family]
    tool("convert_checkpoint").main(export_args(ckpt, str(tmp_path / "back")))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"))
    assert type(back) is type(model)
    assert_same_state(model.state_dict(), back.state_dict())
    files = [load_file(os.path.join(d, "model.safetensors")) for d in (hf_dir, tmp_path / "back")]
    assert_same_state(*files)  # the files too: same names (no tied copy), same tensors
    assert back.config.eos_token_id == model.config.eos_token_id


VARIANTS = [
    ("GPT", dict(activation_function="gelu")),  # exact erf GeLU
    ("GPT", dict(tie_word_embeddings=False)),
    ("llama", dict(attention_bias=True, mlp_bias=True)),
    ("llama", dict(tie_word_embeddings=True, num_key_value_heads=4)),  # tied, no GQA
]


@pytest.mark.parametrize("family,overrides", VARIANTS, ids=lambda v: str(v))
def test_variants_match_in_one_process(family, overrides, tmp_path):
    """More configs at tp 1 without processes (megadyn's whole model from the checkpoint)."""
    from transformers import AutoModelForCausalLM

    from megadyn.convert.generation import load_model

    model = hf_model(family, seed=3, **overrides)
    model.save_pretrained(tmp_path / "hf")
    convert = tool("convert_checkpoint").main
    convert(import_args(str(tmp_path / "hf"), str(tmp_path / "ckpt")))
    ids = tokens()
    ours = load_model(str(tmp_path / "ckpt"))(ids).detach().transpose(0, 1)
    torch.testing.assert_close(ours, hf_logits(model, ids), rtol=0, atol=1e-4)
    convert(export_args(str(tmp_path / "ckpt"), str(tmp_path / "back")))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"))
    assert_same_state(model.state_dict(), back.state_dict())


def test_sharded_safetensors_and_base_model_names(tmp_path):
    """An index with several shards, and GPT-2 names without `transformer.` (as in the
    original `gpt2` repository, saved from GPT2Model)."""
    from safetensors.torch import load_file, save_file

    model = hf_model("GPT", seed=5)
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors.index.json")
    convert = tool("convert_checkpoint").main
    convert(import_args(str(tmp_path / "hf"), str(tmp_path / "ckpt")))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    state = {k.removeprefix("transformer."): v for k, v in model.state_dict().items()}
    state["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)  # an old buffer: not a weight
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, bare / "model.safetensors")
    convert(import_args(str(bare), str(tmp_path / "ckpt2")))
    from megadyn.convert.megadyn_files import load_weights, open_checkpoint

    a, b = (load_weights(open_checkpoint(str(tmp_path / d))) for d in ("ckpt", "ckpt2"))
    assert_same_state(a, b)
    assert load_file(tmp_path / "bare" / "model.safetensors")  # still readable


def test_rope_equals_transformers_rotate_half():
    """megadyn rotates halves, as HF Llama's rotate_half: same tables, same rotation."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from megadyn.models.pointwise import apply_rope
    from megadyn.models.transformer import rope_tables

    b, n, s, d = 2, 3, 7, 16
    q, k = torch.randn(b, n, s, d), torch.randn(b, n, s, d)
    cos, sin = rope_tables(s, d, 500000.0, "cpu", torch.float32)
    hf = LlamaRotaryEmbedding(
        LlamaConfig(hidden_size=n * d, num_attention_heads=n, rope_theta=500000.0)
    )
    hcos, hsin = hf(q, torch.arange(s)[None])  # [1, s, d]
    torch.testing.assert_close(cos, hcos[0], rtol=0, atol=1e-6)
    hq, hk = apply_rotary_pos_emb(q, k, hcos, hsin)
    torch.testing.assert_close(apply_rope(q, cos, sin), hq, rtol=0, atol=1e-6)
    torch.testing.assert_close(apply_rope(k, cos, sin), hk, rtol=0, atol=1e-6)


def test_torch_bin_files_and_bf16(tmp_path):
    """pytorch_model.bin input; --params-dtype bf16 gives a bf16 checkpoint (flag --bf16) that
    exports to a bf16 HF model holding the rounded weights."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    model = hf_model("llama", seed=7)
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "bin").mkdir()
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / "bin" / "config.json")
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    convert = tool("convert_checkpoint").main
    result = convert(
        import_args(str(tmp_path / "bin"), str(tmp_path / "ckpt"), "--params-dtype", "bf16")
    )
    assert result["flags"][-1] == "--bf16"
    meta = json.loads((tmp_path / "ckpt" / "iter_0000000" / "megadyn.json").read_text())
    assert meta["args"]["optimizer.bf16"] and meta["args"]["model.params_dtype"] == "bfloat16"
    convert(export_args(str(tmp_path / "ckpt"), str(tmp_path / "back")))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"))
    rounded = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert_same_state(rounded, back.state_dict())
