"""Global gradient statistics over a parallel layout: norm, clipping, zeros, overflow.

Every gradient element of the global model must be counted exactly once, so:
- a tp-replicated param (not `tensor_model_parallel`) is counted on tp rank 0 only;
- the tied embedding copy of the last pipeline stage (`shared_embedding`) is not counted;
- with the distributed optimizer a dp rank passes only the part it owns, and dp is among the
  groups reduced over; without it dp replicas hold equal grads and dp is left out.
The local sums are then all-reduced over `groups` (a list of process groups, e.g. [dp, mp]).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn


def counts_in_norm(param: nn.Parameter, tp_rank: int, tied_copy: bool = False) -> bool:
    """Whether this rank counts `param` in global gradient statistics (see module docstring);
    `tied_copy`: the tied embedding copy holds parts of its own (replicas of different depth
    under the distributed optimizer shard the word embedding over first and last stages)."""
    if getattr(param, "shared_embedding", False) and not tied_copy:
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def _all_reduce(value: torch.Tensor, groups: Sequence, op=dist.ReduceOp.SUM) -> torch.Tensor:
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(value, op=op, group=group)
    return value


def _device(grads: Sequence[torch.Tensor]) -> torch.device:
    return grads[0].device if grads else torch.device("cpu")


def global_grad_norm(grads: Sequence[torch.Tensor], groups: Sequence, device=None) -> float:
    """L2 norm of the union of `grads` over the ranks of `groups`."""
    device = device or _device(grads)
    if grads:
        norms = torch._foreach_norm([g.float() for g in grads])
        total = torch.stack(norms).square().sum()
    else:
        total = torch.zeros((), dtype=torch.float32, device=device)
    total = _all_reduce(total.reshape(1).to(device), groups)
    return math.sqrt(float(total.item()))


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """The factor that takes the global norm `total_norm` to at most `max_norm` (1.0: none)."""
    return min(1.0, max_norm / (total_norm + 1.0e-6))


def clip_grads(grads: Sequence[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale `grads` in place so that the global norm `total_norm` becomes at most `max_norm`."""
    clip_coeff = clip_coefficient(max_norm, total_norm)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(list(grads), clip_coeff)


def count_zeros(grads: Sequence[torch.Tensor], groups: Sequence, device=None) -> int:
    """Number of zero entries in the union of `grads` over the ranks of `groups`."""
    device = device or _device(grads)
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for grad in grads:
        total += (grad == 0).sum()
    return int(_all_reduce(total, groups).item())


def unscale_and_check_finite(
    grads: Sequence[torch.Tensor], inv_scale: torch.Tensor, groups: Sequence, device=None
) -> bool:
    """Multiply fp32 `grads` by `inv_scale` in place; True if any rank of `groups` saw inf/nan."""
    device = device or _device(grads)
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    if grads:
        torch._amp_foreach_non_finite_check_and_unscale_(
            list(grads), found_inf, inv_scale.to(device)
        )
    return bool(_all_reduce(found_inf, groups, op=dist.ReduceOp.MAX).item() > 0)
