"""Evaluation on the validation split: --eval-iters rounds of forward passes, the mean lm loss.

    value = evaluate(trainer)     # every --eval-interval iterations (Trainer.train)

Round k of the run reads the validation samples after those of rounds 0..k-1, so successive
evaluations see new data and a resumed run sees what the uninterrupted one would have.
"""

from __future__ import annotations

import torch

from megadyn.core.pipeline import forward_backward
from megadyn.training.data_setup import build_loader
from megadyn.training.steps import mean_loss
from megadyn.training.token_steps import draw_token_step


@torch.no_grad()
def evaluate(trainer) -> float | None:
    """The mean validation lm loss over --eval-iters steps of the global batch, printed and
    sent to W&B by the logging rank (which returns it; others return None)."""
    t = trainer.cfg.training
    rounds_done = trainer.state.iteration // t.eval_interval - 1
    gbs = trainer.microbatches.global_batch_size(trainer.state.consumed_samples)
    loader = build_loader(
        trainer.data.valid,
        trainer.cfg,
        trainer.groups.dp_rank,
        trainer.groups.dp_size,
        max(rounds_done, 0) * t.eval_iters * gbs,
        trainer.data.documents,
    )
    n = trainer.microbatches.num_micro_batches(
        trainer.state.consumed_samples, trainer.groups.dp_size
    )
    for c in trainer.chunks:
        c.eval()
    losses = []
    for _ in range(t.eval_iters):
        batches, loss_fn = loader, trainer.loss_fn
        if trainer.token_budget:  # each round has its own micro-batch count
            step = draw_token_step(loader, gbs, trainer.groups, trainer.device)
            batches, n, loss_fn = iter(step.batches), step.num_microbatches, step.loss_fn
        round_losses = forward_backward(
            trainer.ddp,
            trainer.groups,
            batches,
            n,
            config=trainer.pipeline_cfg,
            loss_fn=loss_fn,
            forward_only=True,
        )
        if trainer.token_budget and round_losses:  # a round weighs as one micro batch would
            round_losses = [torch.stack(round_losses).mean()]
        losses += round_losses
    for c in trainer.chunks:
        c.train()
    loss = mean_loss(trainer.parts, losses)
    if loss is not None and trainer.logs:
        value = loss.item()
        trainer.print(
            f" validation loss at iteration {trainer.state.iteration} | lm loss value: {value:.6E} | "
            f"lm loss PPL: {torch.exp(loss).item():.6E} |",
            flush=True,
        )
        trainer.wandb.log({"lm loss validation": value}, step=trainer.state.iteration)
        return value
    return None
