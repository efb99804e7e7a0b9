"""Model FLOPs of a training iteration: the PTD-P paper's count, generalized (GQA, SwiGLU, any
FFN width); for the GPT-2 block with ffn = 4h it is exactly 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)).
Read by the training logs (TFLOP/s, MFU) and the elastic layout planner's cost model."""

from __future__ import annotations

from megadyn.models.config import GPTConfig


def model_flops_per_iteration(cfg: GPTConfig, batch_size: int, seq_length: int, tp: int = 1) -> int:
    """Forward + backward matmul FLOPs of one iteration of `batch_size` sequences (see above);
    the vocabulary is padded as for `tp` tensor-parallel ranks."""
    h, s, f = cfg.hidden_size, seq_length, cfg.ffn_size
    kv = cfg.head_dim * cfg.query_groups  # width of K and of V
    mlp_matrices = 3 if cfg.activation == "swiglu" else 2
    per_token_layer = h * (h + 2 * kv) + 2 * s * h + h * h + mlp_matrices * h * f
    per_token = cfg.num_layers * per_token_layer + h * cfg.padded_vocab_size(tp)
    return 6 * batch_size * s * per_token
