"""Which elements of each parameter this rank's optimizer updates, and gathering them back.

A *shard* is the range of a parameter's flattened elements that one rank updates: all of it
without the distributed optimizer; with it, the intersection of the parameter with the part of
its gradient bucket that the dp rank owns (possibly empty).

To gather one parameter's state: a parameter occupies [p_start, p_end) of its bucket, and dp rank r owns [r*k, (r+1)*k) of the
bucket (k = bucket numel / dp). Rank r's piece of the parameter is the intersection; all ranks
send a [3, m] block (m = min(k, param numel) bounds any piece) holding their piece at the front,
and every rank puts the pieces back together in rank order. Only copies: bit-exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megadyn.core.distributed import Bucket
from megadyn.core.distributed.comm import all_gather_flat

STATE_KEYS = ("main", "exp_avg", "exp_avg_sq")


@dataclass
class ParamShard:
    """The range [start, end) of `param.view(-1)` that this rank updates, and its fp32 copy."""

    param: nn.Parameter
    start: int
    end: int
    main: torch.Tensor  # [end - start] fp32; for fp32 params a view of the param itself
    decay: bool  # in the weight-decay group

    def grad(self) -> torch.Tensor:
        """The matching slice of `param.main_grad`, in fp32."""
        grad = self.param.main_grad.view(-1)[self.start : self.end]
        return grad if grad.dtype == torch.float32 else grad.float()

    def model_slice(self) -> torch.Tensor:
        return self.param.detach().view(-1)[self.start : self.end]


def uses_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Megatron's rule: no weight decay for biases and 1-D parameters (norm weights)."""
    return not (name.endswith(".bias") or param.dim() == 1)


def make_shards(bucket: Bucket, names: dict[nn.Parameter, str]) -> list[ParamShard]:
    """This rank's shards of the params of `bucket`, with fresh fp32 main copies."""
    shards = []
    for param in bucket.params:
        start, end = piece_of_rank(bucket, param, bucket.dp_rank)
        if start == end:
            continue
        flat = param.detach().view(-1)[start:end]
        main = flat if flat.dtype == torch.float32 else flat.float()
        decay = uses_weight_decay(names.get(param, ""), param)
        shards.append(ParamShard(param, start, end, main, decay))
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
