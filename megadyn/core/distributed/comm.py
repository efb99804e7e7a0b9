"""Flat-tensor collectives used by the gradient buffers and the distributed optimizer.

torch renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` (2.13 warns on the old names); these wrappers pick whichever exists so
the same code runs on every torch the project supports. All of them take the group explicitly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
    """Gather equal 1-D `shard`s of every rank of `group` into `output` (rank order).

    `shard` may be the view of `output` that this rank owns (in-place gather).
    """
    return _all_gather(output, shard, group=group, async_op=async_op)


def reduce_scatter_flat(
    shard: torch.Tensor, data: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False
):
    """Reduce 1-D `data` over `group`; this rank receives its equal part into `shard`.

    `shard` may be the view of `data` that this rank owns (in-place reduce-scatter).
    """
    return _reduce_scatter(shard, data, op=op, group=group, async_op=async_op)
