"""Tiny random Hugging Face GPT-2 and Llama models (no download) for the conversion tests."""

from __future__ import annotations

import os
import sys

import torch

from tests.tiny import TRAINING, tiny_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 100
SEQ = 12


def tool(name: str):
    """tools/<name>.py imported as a module (tools/ is not a package)."""
    tools = os.path.join(REPO, "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    return __import__(name)


def hf_model(family: str, seed: int = 0, **overrides):
    """A random GPT2LMHeadModel or LlamaForCausalLM: 2 layers, hidden 64, 4 heads (Llama: 2 kv
    heads), vocab 100; every weight perturbed so that norms and biases are not trivial."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if family == "GPT":
        kw = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32)
        kw.update(bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
        model = GPT2LMHeadModel(GPT2Config(**{**kw, **overrides}))
    else:
        kw = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
        kw.update(num_key_value_heads=2, intermediate_size=96, vocab_size=VOCAB)
        kw.update(max_position_embeddings=32, rope_theta=10000.0)
        model = LlamaForCausalLM(LlamaConfig(**{**kw, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def tokens(seed: int = 1, batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=gen)


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits  # [b, s, V]


def import_args(hf_dir: str, save_dir: str, *extra: str) -> list[str]:
    return [
        "--loader", "hf", "--saver", "megadyn", "--load-dir", hf_dir, "--save-dir", save_dir,
        "--make-vocab-size-divisible-by", "8", "--no-progress", *extra,
    ]  # fmt: skip


def export_args(ckpt: str, save_dir: str, *extra: str) -> list[str]:
    return ["--loader", "megadyn", "--saver", "hf", "--load-dir", ckpt, "--save-dir", save_dir,
            "--no-progress", *extra]  # fmt: skip


def assert_same_state(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b), set(a) ^ set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


TRAIN = tiny_args(TRAINING, max_position_embeddings=32, openai_gelu=True)
"""pretrain_gpt.py flags of a tiny job on mock data (GPT-2 block with GPT-2's tanh GeLU;
NullTokenizer: vocabulary 61)."""


def run_pretrain(rank, world, argv):
    import pretrain_gpt

    return pretrain_gpt.main(list(argv))


def train(world: int, argv: list[str]) -> list[float]:
    """pretrain_gpt.main on `world` spawned processes; the logging (last) rank's losses."""
    from megadyn.testing import spawn

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    results = spawn(run_pretrain, world=world, args=(list(argv),))
    return next(r.history for r in reversed(results) if r.history)


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Megatron writes an index file and a binary file for every dataset.",
    "Numbers like 1234 and 56.78 are split into digits; symbols like {} and <> stay.",
    "Unicode text: café, naïve, Zürich, 東京, emoji 🙂.",
]
"""Training text of the tiny SentencePiece models, and texts their tokenizers are checked on."""


def sentencepiece_model(directory: str, vocab_size: int = 400) -> str:
    """A tiny byte-fallback BPE SentencePiece model (megadyn's train_sentencepiece defaults)."""
    from megadyn.data.sp_train import train_sentencepiece

    corpus = os.path.join(directory, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write("\n".join(TEXTS * 20) + "\n")
    return train_sentencepiece([corpus], os.path.join(directory, "spm"), vocab_size=vocab_size)


def with_tokenizer(argv: list[str], *tokenizer: str) -> list[str]:
    """`argv` (TRAIN-like) with its NullTokenizer flags replaced by `tokenizer`."""
    out = list(argv)
    for flag in ("--tokenizer-type", "--vocab-size"):
        i = out.index(flag)
        del out[i : i + 2]
    return out + list(tokenizer)
