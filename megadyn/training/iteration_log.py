"""The trainer's log every --log-interval iterations: one measurement of the window, printed
as the iteration line, sent to W&B and appended to the metrics file.

    history += log_window(trainer, window, grad_norm, seconds, iters)   # Trainer.train
"""

from __future__ import annotations

import torch

from megadyn.training.metrics import (
    IterationStats,
    device_peak_tflops,
    format_iteration_line,
    mfu,
    model_flops_per_iteration,
    wandb_metrics,
)


def log_window(trainer, window, grad_norm, seconds: float, iters: int) -> list[float]:
    """The losses of the iterations in `window` ((iteration, loss tensor) pairs), recorded in
    `trainer.loss_by_iteration`; on the logging rank also the iteration line, W&B and the
    metrics file, over `iters` iterations that took `seconds`."""
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    values = [w.item() for _, w in window]
    trainer.step_seconds = seconds / iters
    trainer.loss_by_iteration.update((i, v) for (i, _), v in zip(window, values))
    real_tokens, trainer.window_tokens = int(trainer.window_tokens), 0  # a device count
    if trainer.logs:
        _log_line(trainer, values, grad_norm, seconds, iters, real_tokens)
    trainer.stragglers.report(trainer)  # every member: the per-rank step parts
    return values


def _log_line(trainer, values, grad_norm, seconds: float, iters: int, real_tokens: int) -> None:
    """The iteration line, W&B and the metrics file (the logging rank)."""
    cfg, s = trainer.cfg, trainer.state
    gbs = trainer.microbatches.global_batch_size(s.consumed_samples)
    world = trainer.groups.layout.world_size
    seq_length = cfg.data.seq_length
    if trainer.token_budget:  # the mean real (unpadded) sample length of the window
        seq_length = real_tokens / max(gbs * iters, 1)
    flops = model_flops_per_iteration(trainer.model_cfg, gbs, seq_length, trainer.groups.tp_size)
    tflops = flops * iters / seconds / world / 1e12
    peak = (
        torch.cuda.max_memory_allocated(trainer.device) / 2**30
        if trainer.device.type == "cuda"
        else None
    )
    device_peak = device_peak_tflops(trainer.device)
    stats = IterationStats(
        iteration=s.iteration,
        train_iters=trainer.train_iters,
        consumed_samples=s.consumed_samples,
        elapsed_ms=1000 * seconds / iters,
        learning_rate=trainer.scheduler.lr,
        global_batch_size=gbs,
        losses={"lm loss": sum(values) / max(len(values), 1)},
        loss_scale=trainer.optimizer.loss_scale,
        grad_norm=grad_norm,
        skipped_iterations=s.skipped_iterations,
        nan_iterations=s.nan_iterations,
        tflops_per_gpu=tflops,
        tokens_per_sec=gbs * seq_length * iters / seconds,
        mfu=None if device_peak is None else mfu(tflops, device_peak),
        peak_mem_gib=peak,
    )
    line = format_iteration_line(stats, log_throughput=cfg.logging.log_throughput)
    trainer.print(line, flush=True)
    trainer.wandb.log(wandb_metrics(stats), step=s.iteration)
    trainer.metrics_log.iteration(stats)
