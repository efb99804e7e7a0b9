"""Model FLOPs, MFU and the per-iteration log line (Megatron's format plus megadyn's fields).

    flops = model_flops_per_iteration(cfg.model, batch_size=gbs, seq_length=s, tp=tp)
    tflops_per_gpu = flops / (seconds_per_iteration * 1e12 * world_size)
    stats = IterationStats(iteration=10, train_iters=100, ..., tflops_per_gpu=tflops_per_gpu)
    print(format_iteration_line(stats, log_throughput=cfg.logging.log_throughput))  # last rank
    wandb_logger.log(wandb_metrics(stats), step=10)

FLOPs count matrix multiplications only, forward and backward (x3), two FLOPs per
multiply-add, and no recomputation (model FLOPs, as for MFU). Per layer and token, with h the
hidden size, s the sequence, n query heads of which g key/value groups, f the MLP width:

    QKV projection      h * (h + 2 h g / n)
    attention           2 s h          (Q K^T and (softmax) V over the full s x s square)
    output projection   h * h
    MLP                 2 h f          (3 h f with SwiGLU: gate, up and down projections)

plus the logits, h * V per token with V the padded vocabulary. Total:

    F = 6 B s [ l (h (h + 2 h g / n) + 2 s h + h h + {2|3} h f) + h V ]

With g = n, f = 4h and GeLU this is exactly the PTD-P paper's (Narayanan et al. 2021, eq. 3
without recomputation) 72 B s l h^2 (1 + s / (6 h) + V / (12 l h)), the formula the shared
Megatron-Core benchmark uses, so numbers compare across frameworks. Megatron-LM's current training.py halves
the attention term for the causal mask; its TFLOP/s read lower than these by that term.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from megadyn.models.flops import model_flops_per_iteration  # noqa: F401 (re-exported)

H100_BF16_PEAK_TFLOPS = 989.0
"""Dense bf16 peak of an H100 SXM (and H200), in TFLOP/s."""


PEAK_TFLOPS_BY_NAME = {"H100": H100_BF16_PEAK_TFLOPS, "H200": H100_BF16_PEAK_TFLOPS}
"""Dense bf16 peaks of the GPUs MFU is measured against, by a part of the device's name."""


def mfu(tflops_per_gpu: float, peak: float = H100_BF16_PEAK_TFLOPS) -> float:
    """Model FLOPs utilization, a fraction of `peak` (TFLOP/s per GPU)."""
    return tflops_per_gpu / peak


def device_peak_tflops(device) -> float | None:
    """The dense bf16 peak of `device` (a torch.device), in TFLOP/s; None on a CPU or a GPU
    not in PEAK_TFLOPS_BY_NAME, where the iteration line then shows no MFU."""
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((p for part, p in PEAK_TFLOPS_BY_NAME.items() if part in name), None)


@dataclass(frozen=True)
class IterationStats:
    """What one log line reports, averaged over the iterations since the previous line."""

    iteration: int
    """Iterations done."""
    train_iters: int
    """Iterations of the whole run."""
    consumed_samples: int
    """Samples consumed so far (the data cursor)."""
    elapsed_ms: float
    """Wall time per iteration, milliseconds."""
    learning_rate: float
    """Learning rate of the last iteration."""
    global_batch_size: int
    """Samples of the last iteration."""
    losses: dict[str, float]
    """Averaged losses by name, e.g. {'lm loss': 2.31}."""
    loss_scale: float = 1.0
    """Loss scale (1.0 without fp16)."""
    grad_norm: float | None = None
    """Global gradient norm before clipping."""
    skipped_iterations: int = 0
    """Iterations whose update was skipped (fp16 overflow)."""
    nan_iterations: int = 0
    """Iterations with a NaN loss."""
    tflops_per_gpu: float | None = None
    """Model TFLOP/s per GPU (in the log line with --log-throughput; MFU is derived from it)."""
    tokens_per_sec: float | None = None
    """Tokens per second, whole job."""
    mfu: float | None = None
    """Model FLOPs utilization, a fraction."""
    peak_mem_gib: float | None = None
    """Peak allocated accelerator memory, GiB."""


def format_iteration_line(
    stats: IterationStats, now: datetime | None = None, log_throughput: bool = False
) -> str:
    """Megatron's training_log line, then megadyn's tokens/s, MFU and peak memory.

    As in Megatron, the "throughput per GPU (TFLOP/s/GPU)" field is there only with
    `log_throughput` (--log-throughput); tokens/s is always there, MFU where the device's
    peak is known (device_peak_tflops).
    """
    st = stats
    line = f" [{(now or datetime.now()).strftime('%Y-%m-%d %H:%M:%S')}]"
    line += f" iteration {st.iteration:8d}/{st.train_iters:8d} |"
    line += f" consumed samples: {st.consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {st.elapsed_ms:.1f} |"
    if log_throughput and st.tflops_per_gpu is not None:
        line += f" throughput per GPU (TFLOP/s/GPU): {st.tflops_per_gpu:.1f} |"
    line += f" learning rate: {st.learning_rate:.6E} |"
    line += f" global batch size: {st.global_batch_size:5d} |"
    for name, value in st.losses.items():
        line += f" {name}: {value:.6E} |"
    line += f" loss scale: {st.loss_scale:.1f} |"
    if st.grad_norm is not None:
        line += f" grad norm: {st.grad_norm:.3f} |"
    line += f" number of skipped iterations: {st.skipped_iterations:3d} |"
    line += f" number of nan iterations: {st.nan_iterations:3d} |"
    if st.tokens_per_sec is not None:
        line += f" tokens/s: {st.tokens_per_sec:.0f} |"
    if st.mfu is not None:
        line += f" MFU: {100 * st.mfu:.1f}% |"
    if st.peak_mem_gib is not None:
        line += f" peak mem (GiB): {st.peak_mem_gib:.2f} |"
    return line


def wandb_metrics(stats: IterationStats) -> dict[str, float]:
    """The same numbers under Megatron's W&B keys (plus megadyn's), for WandbLogger.log."""
    st = stats
    out = {
        "iteration-time": st.elapsed_ms / 1000.0,
        "learning-rate": st.learning_rate,
        "batch-size": st.global_batch_size,
        "samples vs steps": st.consumed_samples,
        "loss-scale": st.loss_scale,
        **st.losses,
    }
    optional = {
        "grad-norm": st.grad_norm,
        "throughput": st.tflops_per_gpu,
        "tokens-per-sec": st.tokens_per_sec,
        "mfu": st.mfu,
        "peak-mem-gib": st.peak_mem_gib,
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    return out
