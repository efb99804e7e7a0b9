"""Text generation from a megadyn checkpoint on one process (tp 1, pp 1), for sanity checks.

    model = load_model("ckpt/")                        # any layout's checkpoint, read whole
    ids = generate(model, [1, 2, 3], 16)               # greedy
    ids = generate(model, prompt, 16, SamplingConfig(temperature=0.8, top_k=50, top_p=0.9, seed=1))

No KV cache: every step runs the whole sequence (tools/generate.py is a check, not a server).
Sampling follows Hugging Face's order: temperature, then top-k, then top-p (nucleus).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megadyn.convert.errors import ConversionError
from megadyn.convert.megadyn_files import load_weights, open_checkpoint
from megadyn.models import GPTModel


@dataclass(frozen=True)
class SamplingConfig:
    greedy: bool = True
    """Take the most likely token (--greedy); the other fields are then unused."""
    temperature: float = 1.0
    """Divide logits by this before sampling (--temperature)."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 = all (--top-k)."""
    top_p: float = 1.0
    """Sample among the most likely tokens whose probabilities sum to p (--top-p)."""
    seed: int = 0
    """Seed of the sampling generator (--seed)."""

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")


@torch.no_grad()
def load_model(path: str, device: str = "cpu") -> GPTModel:
    """The whole model (one chunk, no tensor parallelism) with the checkpoint's weights."""
    ckpt = open_checkpoint(path, flag="--load")
    cfg = ckpt.cfg.with_(hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, device=device)
    weights = load_weights(ckpt)
    for name, param in model.named_parameters():
        param.copy_(weights[name])
    return model.eval()


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] with every token outside the top-k / top-p set at -inf."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # mass before the token >= p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def next_token(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator) -> int:
    if cfg.greedy:
        return int(logits.argmax())
    probs = filter_logits(logits / cfg.temperature, cfg.top_k, cfg.top_p).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=gen))


@torch.no_grad()
def generate(
    model: GPTModel,
    prompt: list[int],
    num_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    stop_token: int | None = None,
) -> list[int]:
    """`prompt` followed by up to `num_tokens` new tokens (fewer at `stop_token`)."""
    cfg = model.cfg
    if not prompt:
        raise ConversionError("empty prompt: give --prompts text or --prompt-ids")
    if max(prompt) >= cfg.vocab_size or min(prompt) < 0:
        raise ConversionError(f"prompt ids must be in [0, {cfg.vocab_size}), got {prompt}")
    learned = cfg.position_embedding_type == "learned_absolute"
    if learned and len(prompt) + num_tokens > cfg.max_position_embeddings:
        raise ConversionError(
            f"--num-tokens-to-generate {num_tokens} + prompt {len(prompt)} exceeds the "
            f"model's --max-position-embeddings {cfg.max_position_embeddings}"
        )
    gen = torch.Generator().manual_seed(sampling.seed)
    device = next(model.parameters()).device
    ids = list(prompt)
    for _ in range(num_tokens):
        x = torch.tensor([ids], device=device)  # [1, s]
        logits = model(x)[-1, 0].float()  # [V] at the last position
        ids.append(next_token(logits, sampling, gen))
        if stop_token is not None and ids[-1] == stop_token:
            break
    return ids
