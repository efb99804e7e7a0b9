"""Collectives over dim 0 of a tensor, for every caller in megadyn: the gradient buffers and the
distributed optimizer (1-D buffers), the tensor- and sequence-parallel gathers and scatters
([s, b, h] activations) and the pipeline's split sends.

torch renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` (2.13 warns on the old names, on every rank, again after each
checkpoint's `warnings.catch_warnings`); these wrappers pick whichever exists so the same code
runs on every torch the project supports. Call them, never the torch names. All of them take
the group explicitly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
    """Gather the equal `shard`s [n, ...] of every rank of `group` into `output`, rank after
    rank along dim 0 ([world * n, ...], or stacked [world, n, ...]).

    `shard` may be the view of `output` that this rank owns (in-place gather).
    """
    return _all_gather(output, shard, group=group, async_op=async_op)


def reduce_scatter_flat(
    shard: torch.Tensor, data: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False
):
    """Reduce `data` [world * n, ...] over `group`; this rank receives its part [n, ...] of dim
    0 into `shard`.

    `shard` may be the view of `data` that this rank owns (in-place reduce-scatter).
    """
    return _reduce_scatter(shard, data, op=op, group=group, async_op=async_op)


class _StreamDone:
    """The handle of collectives queued on a side stream: `wait()` makes the current stream
    wait for them (the host does not block)."""

    def __init__(self, stream):
        self._event = torch.cuda.Event()
        self._event.record(stream)

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self._event)


def reduce_scatter_all_reduce(
    shard: torch.Tensor,
    data: torch.Tensor,
    shard_group,
    replica_group,
    op=dist.ReduceOp.SUM,
    stream=None,
):
    """Reduce `data` over shard_group x replica_group; this rank receives its part in `shard`:
    a reduce-scatter within `shard_group`, then an all-reduce of the part over `replica_group`
    (the ranks that receive the same part). The second needs the first's result, so on CUDA
    both are queued in order on the side `stream` and the returned handle's `wait()` makes the
    current stream wait for them; without a stream (CPU) they run before this returns (None).
    """
    if stream is None:
        _reduce_twice(shard, data, shard_group, replica_group, op)
        return None
    stream.wait_stream(torch.cuda.current_stream())  # the gradients are written
    with torch.cuda.stream(stream):
        _reduce_twice(shard, data, shard_group, replica_group, op)
    return _StreamDone(stream)


def _reduce_twice(shard, data, shard_group, replica_group, op) -> None:
    if dist.get_world_size(shard_group) > 1:  # one rank per instance: `shard` is `data`
        reduce_scatter_flat(shard, data, shard_group, op=op)
    dist.all_reduce(shard, op=op, group=replica_group)
