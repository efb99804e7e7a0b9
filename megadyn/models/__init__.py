"""GPT models built from megadyn's tensor-parallel layers, and their state description."""

from megadyn.models.config import GPTConfig
from megadyn.models.gpt import (
    GPTModel,
    build_gpt_chunks,
    init_chunk,
    lm_loss,
    lm_loss_for,
    masked_mean,
)

__all__ = [
    "GPTConfig",
    "GPTModel",
    "build_gpt_chunks",
    "init_chunk",
    "lm_loss",
    "lm_loss_for",
    "masked_mean",
]
