"""Which elements of each parameter this rank's optimizer updates, and gathering them back.

A *shard* is the range of a parameter's flattened elements that one rank updates: all of it
without the distributed optimizer; with it, the intersection of the parameter with the part of
its gradient bucket that the dp rank owns (possibly empty). A `ParamShard` holds the shard's
fp32 main value (a copy, a view of an fp32 param, or an int16 remainder beside a bf16 param's
slice: remainders.py) and its Adam state, which adamw.py updates.

To gather one parameter's state: a parameter occupies [p_start, p_end) of its bucket, and dp rank r owns [r*k, (r+1)*k) of the
bucket (k = bucket numel / dp). Rank r's piece of the parameter is the intersection; all ranks
send a [3, m] block (m = min(k, param numel) bounds any piece) holding their piece at the front,
and every rank puts the pieces back together in rank order. Only copies: bit-exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from megadyn.core.distributed import Bucket
from megadyn.core.distributed.comm import all_gather_flat
from megadyn.core.optimizer.remainders import join, split_into

STATE_KEYS = ("main", "exp_avg", "exp_avg_sq")


@dataclass(eq=False)
class ParamShard:
    """The range [start, end) of `param.view(-1)` that this rank updates, its fp32 main value
    and its Adam state."""

    param: nn.Parameter
    start: int
    end: int
    main: torch.Tensor | None  # [end - start] fp32; for fp32 params a view of the param itself
    decay: bool  # in the weight-decay group
    remainder: torch.Tensor | None = None
    """[end - start] int16 in place of `main` (None then) under --use-precision-aware-optimizer:
    the model slice and it make the fp32 main value (remainders.py)."""
    adam: dict[str, torch.Tensor] = field(default_factory=dict)
    """exp_avg, exp_avg_sq ([end - start] fp32) and step (a scalar), once stepped or loaded."""
    sharded_grad: torch.Tensor | None = None
    """[end - start] gradient under --data-parallel-sharding-strategy optim_grads: the piece of
    the bucket's `grad_shard` (there is no full `param.main_grad` then)."""

    def grad(self) -> torch.Tensor:
        """The matching slice of `param.main_grad` (or `sharded_grad`), in fp32."""
        grad = self.sharded_grad
        if grad is None:
            grad = self.param.main_grad.view(-1)[self.start : self.end]
        return grad if grad.dtype == torch.float32 else grad.float()

    def model_slice(self) -> torch.Tensor:
        return self.param.detach().view(-1)[self.start : self.end]

    def main_value(self) -> torch.Tensor:
        """The fp32 main value: `main` itself, or joined from model slice and remainder (new)."""
        return self.main if self.remainder is None else join(self.model_slice(), self.remainder)

    @torch.no_grad()
    def set_main(self, value: torch.Tensor) -> None:
        """Set the fp32 main value from flat `value`; with a remainder the model slice too (to
        the high half, which a cast to bf16 would round differently at ties)."""
        value = value.to(device=self.param.device, dtype=torch.float32).reshape(-1)
        if self.remainder is None:
            self.main.copy_(value)
        else:
            split_into(value, self.model_slice(), self.remainder)


def uses_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Megatron's rule: no weight decay for biases and 1-D parameters (norm weights)."""
    return not (name.endswith(".bias") or param.dim() == 1)


def make_shards(
    bucket: Bucket, names: dict[nn.Parameter, str], *, remainders: bool = False
) -> list[ParamShard]:
    """This rank's shards of the params of `bucket`, with fresh fp32 main copies; with
    `remainders`, bf16 params get a zero remainder instead (their main value is the weight)."""
    shards = []
    for param in bucket.params:
        start, end = piece_of_rank(bucket, param, bucket.dp_rank)
        if start == end:
            continue
        flat = param.detach().view(-1)[start:end]
        decay = uses_weight_decay(names.get(param, ""), param)
        if flat.dtype == torch.float32:
            shards.append(ParamShard(param, start, end, flat, decay))
        elif remainders and flat.dtype == torch.bfloat16:
            remainder = torch.zeros(end - start, dtype=torch.int16, device=flat.device)
            shards.append(ParamShard(param, start, end, None, decay, remainder))
        elif remainders:
            raise ValueError(
                f"--use-precision-aware-optimizer needs bf16 params, {names.get(param, '?')} "
                f"is {flat.dtype}"
            )
        else:
            shards.append(ParamShard(param, start, end, flat.float(), decay))
        if hasattr(bucket, "shard_grad"):  # optim_grads: ShardedGradBucket
            shards[-1].sharded_grad = bucket.shard_grad(param)
    return shards


def piece_of_rank(bucket: Bucket, param: nn.Parameter, dp_rank: int) -> tuple[int, int]:
    """Range of `param`'s flattened elements that `dp_rank` owns (possibly empty)."""
    p_start, p_end = bucket.param_ranges[param]
    lo, hi = bucket.shard_range(dp_rank)
    start, end = max(p_start, lo), min(p_end, hi)
    return (start - p_start, end - p_start) if start < end else (0, 0)


def gather_param_state(
    bucket: Bucket, param: nn.Parameter, pieces: Sequence[torch.Tensor]
) -> torch.Tensor:
    """[len(STATE_KEYS), numel] state of `param` from this rank's `pieces` (one per key, or none
    if this rank owns no part of it), all-gathered over the bucket's dp group."""
    numel = param.numel()
    rows = len(STATE_KEYS)
    width = min(bucket.numel // bucket.dp_size, numel)
    send = torch.zeros(rows, width, dtype=torch.float32, device=param.device)
    if pieces:
        piece = torch.stack(list(pieces))  # [3, piece length]
        send[:, : piece.shape[1]] = piece
    recv = torch.empty(bucket.dp_size, rows, width, dtype=torch.float32, device=param.device)
    all_gather_flat(recv.view(-1), send.view(-1), bucket.dp_group)
    out = torch.empty(rows, numel, dtype=torch.float32, device=param.device)
    for rank in range(bucket.dp_size):
        start, end = piece_of_rank(bucket, param, rank)
        out[:, start:end] = recv[rank, :, : end - start]
    return out
