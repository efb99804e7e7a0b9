"""AdamW over this rank's `ParamShard`s, with the Adam state each shard holds (`shard.adam`).

    adamw_update(shards, grads, AdamHyper(lr, weight_decay, betas, eps), fused=x.is_cuda, step=t)

The update is torch's own: `torch.optim.adam.adam(..., decoupled_weight_decay=True)`, the
function `torch.optim.AdamW.step` calls, fused on CUDA and foreach on the CPU. Its arithmetic
is elementwise, so the result does not depend on how shards are grouped into calls: the same
main value, gradient and state give the same bits as `torch.optim.AdamW` would.

A shard keeps its fp32 main value either as a tensor (`shard.main`, updated in place) or,
under --use-precision-aware-optimizer, as its bf16 model slice plus an int16 remainder
(remainders.py). On CUDA such a shard is updated in one pass by adam_kernels.py (it reads the
weight, remainder, gradient and moments once: 28 bytes an element against 34 for an fp32 main
copy, its fused update and its cast; the same formula as torch's AdamW, to a few units in the
last place). Elsewhere they are joined into an fp32 scratch buffer of at most `scratch_numel`
elements at a time (more when a single shard is larger), updated by torch's function, and
split back: the model slice gets the new high half, the remainder the rest.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.optim.adam import adam

from megadyn.core.optimizer.adam_kernels import adamw_remainders_
from megadyn.core.optimizer.remainders import join_into, split_into
from megadyn.core.optimizer.shards import ParamShard

SCRATCH_NUMEL = 2**26
"""Largest fp32 scratch (256 MiB) of joined main values that one update call uses."""


@dataclass(frozen=True)
class AdamHyper:
    """The values of one update (the schedule changes lr and weight decay between steps)."""

    lr: float
    weight_decay: float
    """Of the decayed shards; the others (biases, 1-D params) get 0."""
    betas: tuple[float, float]
    eps: float


def step_tensor(value: int, device: torch.device, fused: bool) -> torch.Tensor:
    """Adam's step counter as torch keeps it: on the device when fused, else on the CPU."""
    return torch.tensor(float(value), dtype=torch.float32, device=device if fused else "cpu")


def set_adam_state(shard: ParamShard, exp_avg, exp_avg_sq, step: int, fused: bool) -> None:
    """Set `shard.adam` from flat fp32 moments (copied) and the step count."""
    device = shard.param.device
    shard.adam["exp_avg"] = exp_avg.to(device=device, dtype=torch.float32).reshape(-1).clone()
    shard.adam["exp_avg_sq"] = exp_avg_sq.to(device=device, dtype=torch.float32).reshape(-1).clone()
    shard.adam["step"] = step_tensor(step, device, fused)


@torch.no_grad()
def adamw_update(
    shards: Sequence[ParamShard],
    grads: Sequence[torch.Tensor],
    hyper: AdamHyper,
    *,
    fused: bool,
    step: int,
    scratch_numel: int = SCRATCH_NUMEL,
    grad_scale: float = 1.0,
) -> None:
    """One AdamW step, the `step`-th (from 1), of every shard with its fp32 gradient times
    `grad_scale` (the clip: the one-pass kernel multiplies as it reads the gradient, the other
    shards' gradients are scaled in place first); state made at the first step."""
    for shard in shards:
        if not shard.adam:  # as torch's AdamW does at a parameter's first step
            zeros = torch.zeros(shard.end - shard.start, device=shard.param.device)
            set_adam_state(shard, zeros, zeros, 0, fused)
    pairs = list(zip(shards, grads))
    if fused:  # remainders on CUDA: the one-pass kernel
        one_pass = [(s, g) for s, g in pairs if s.remainder is not None]
        for shard, grad in one_pass:
            _one_pass(shard, grad, hyper, step, grad_scale)
        if one_pass:  # the counters as torch's update counts them: one launch, no host read
            torch._foreach_add_([s.adam["step"] for s, _ in one_pass], 1)
        pairs = [(s, g) for s, g in pairs if s.remainder is None]
    if grad_scale != 1.0 and pairs:
        torch._foreach_mul_([g for _, g in pairs], grad_scale)
    for decay in (True, False):
        pairs_of = [(s, g) for s, g in pairs if s.decay == decay]
        for chunk in _chunks(pairs_of, scratch_numel):
            _update(chunk, hyper, hyper.weight_decay if decay else 0.0, fused)


def _one_pass(shard: ParamShard, grad: torch.Tensor, hyper: AdamHyper, step: int, grad_scale):
    adam = shard.adam
    adamw_remainders_(
        shard.model_slice(), shard.remainder, grad.contiguous(), adam["exp_avg"],
        adam["exp_avg_sq"], lr=hyper.lr, beta1=hyper.betas[0], beta2=hyper.betas[1],
        eps=hyper.eps, weight_decay=hyper.weight_decay if shard.decay else 0.0, step=step,
        grad_scale=grad_scale,
    )  # fmt: skip


def _chunks(pairs, scratch_numel: int) -> Iterator[list[tuple[ParamShard, torch.Tensor]]]:
    """Runs of consecutive shards whose remainders join into at most `scratch_numel` floats
    (a larger shard alone)."""
    chunk, numel = [], 0
    for shard, grad in pairs:
        n = 0 if shard.remainder is None else shard.end - shard.start
        if chunk and numel + n > scratch_numel:
            yield chunk
            chunk, numel = [], 0
        chunk.append((shard, grad))
        numel += n
    if chunk:
        yield chunk


def _update(chunk, hyper: AdamHyper, weight_decay: float, fused: bool) -> None:
    joined = [s for s, _ in chunk if s.remainder is not None]
    scratch = None
    if joined:
        numel = sum(s.end - s.start for s in joined)
        scratch = torch.empty(numel, dtype=torch.float32, device=joined[0].param.device)
    mains, offset = [], 0
    for shard, _ in chunk:
        if shard.remainder is None:
            mains.append(shard.main)
            continue
        main = scratch[offset : offset + shard.end - shard.start]
        offset += main.numel()
        mains.append(join_into(shard.model_slice(), shard.remainder, main))
    adam(
        mains,
        [g for _, g in chunk],
        [s.adam["exp_avg"] for s, _ in chunk],
        [s.adam["exp_avg_sq"] for s, _ in chunk],
        [],
        [s.adam["step"] for s, _ in chunk],
        foreach=None if fused else True,
        fused=True if fused else None,
        amsgrad=False,
        has_complex=False,
        beta1=hyper.betas[0],
        beta2=hyper.betas[1],
        lr=hyper.lr,
        weight_decay=weight_decay,
        eps=hyper.eps,
        maximize=False,
        decoupled_weight_decay=True,
    )
    for (shard, _), main in zip(chunk, mains):
        if shard.remainder is not None:
            split_into(main, shard.model_slice(), shard.remainder)
