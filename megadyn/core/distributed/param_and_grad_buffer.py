"""Contiguous gradient (and parameter) buffers split into buckets, as Megatron lays them out.

For each (param dtype, grad dtype) pair of a model chunk one flat `grad_data` tensor holds the
gradients of all its parameters, in reverse order of registration (the order in which backward
produces them), and each parameter gets `param.main_grad`, a view of its slice:

    grad_data  [ p_n | p_n-1 | ... | p_k || p_k-1 | ... | p_1 | pad ]
                 <----- bucket 0 ----->   <------ bucket 1 ------->

A bucket closes once it holds `bucket_size` elements; its gradients are reduced over the
data-parallel group in one collective. With the distributed optimizer (ZeRO-1) each bucket is
padded to a multiple of lcm(dp, 128) and data-parallel rank r owns the contiguous part
`[r * numel / dp, (r + 1) * numel / dp)` of every bucket: its gradients are reduce-scattered
there, its optimizer keeps main params and Adam state only for that part, and the updated
parameters are all-gathered back. For that the parameters themselves are moved into a
`param_data` buffer of the same layout (`param.data` becomes a view of it), so do not move or
cast the model (`.to()`, `.half()`) after wrapping it.

With several distributed-optimizer instances (--num-distributed-optimizer-instances) the
buffer is sharded over the ranks of one instance (`dp_group` here is that instance's group):
gradients are reduce-scattered within it and each part is then all-reduced over
`replica_group`, the ranks of the other instances that own the same part, so the gradient is
still averaged over all of data parallelism and every instance takes the same step.

`plan_buckets` computes the layout from the param sizes alone, without processes, for code that
must know which dp rank owns which elements (the reshard planner).

With `shard_grads` (--data-parallel-sharding-strategy optim_grads, ZeRO-2) there is no
`grad_data`: only `grad_shard`, this dp rank's parts of every bucket, persists, and the buckets
stage their full gradients per micro batch (sharded_grads.py).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import nn

from megadyn.core.distributed.comm import (
    all_gather_flat,
    reduce_scatter_all_reduce,
    reduce_scatter_flat,
)

_DIST_OPT_PAD = 128  # bucket sizes are multiples of lcm(dp, 128) with the distributed optimizer


def plan_buckets(
    numels: list[int],
    *,
    dp_size: int,
    bucket_size: int | None,
    use_distributed_optimizer: bool,
    separate: list[bool] | None = None,
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """The buffer layout, as a pure function of the param sizes (in registration order).

    Returns `(start, end, bucket index)` of each param and `(start, end)` of each bucket.
    Params are laid out in reverse order; a bucket closes once it holds `bucket_size`
    elements, and around params flagged in `separate` (tied embeddings with the distributed
    optimizer, so that both pipeline stages shard them alike). With the distributed optimizer
    each bucket is padded to a multiple of lcm(dp, 128).
    """
    pad = math.lcm(dp_size, _DIST_OPT_PAD) if use_distributed_optimizer else 1
    separate = separate or [False] * len(numels)
    ranges: list[tuple[int, int, int]] = [(0, 0, 0)] * len(numels)
    buckets: list[tuple[int, int]] = []
    offset, bucket_start, in_bucket = 0, 0, 0

    def close_bucket() -> None:
        nonlocal offset, bucket_start, in_bucket
        offset = math.ceil(offset / pad) * pad
        buckets.append((bucket_start, offset))
        bucket_start, in_bucket = offset, 0

    for i in reversed(range(len(numels))):
        if separate[i] and in_bucket:
            close_bucket()
        ranges[i] = (offset, offset + numels[i], len(buckets))
        offset, in_bucket = offset + numels[i], in_bucket + 1
        if separate[i] or (bucket_size is not None and offset - bucket_start >= bucket_size):
            close_bucket()
    if in_bucket:
        close_bucket()
    return ranges, buckets


class Bucket:
    """A slice of a buffer whose gradients are reduced over data parallelism in one collective."""

    def __init__(
        self,
        index: int,
        params: list[nn.Parameter],
        param_ranges: dict[nn.Parameter, tuple[int, int]],
        offset: int,
        grad_data: torch.Tensor,
        param_data: torch.Tensor | None,
        dp_group,
        *,
        use_distributed_optimizer: bool,
        gradient_scaling_factor: float,
        average_in_collective: bool,
        replica_group=None,
        comm_stream=None,
        numel: int | None = None,
    ):
        self.index = index
        self.params = params
        self.param_ranges = param_ranges  # param -> (start, end) within this bucket
        self.offset = offset  # start of the bucket within its buffer
        self.grad_data = grad_data  # [numel] view of the buffer
        self.param_data = param_data  # [numel] view, distributed optimizer only
        self.dp_group = dp_group  # with the distributed optimizer: the ranks sharding it
        self.dp_size = dist.get_world_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group)
        self.replica_group = replica_group  # the same part in the other optimizer instances
        self.comm_stream = comm_stream  # where the two-step reduction runs on CUDA
        self.use_distributed_optimizer = use_distributed_optimizer
        self.gradient_scaling_factor = gradient_scaling_factor
        self.average_in_collective = average_in_collective
        self._ready: set[nn.Parameter] = set()
        self._handle = None
        self._launched = False  # the reduction was started (by the hooks or by start_grad_sync)
        self._synced = False  # ... and finished: main_grad is final until the next reset()
        self.numel = grad_data.numel() if numel is None else numel

    def shard_range(self, dp_rank: int | None = None) -> tuple[int, int]:
        """Range of this bucket that `dp_rank` owns (all of it without the distributed optimizer)."""
        if not self.use_distributed_optimizer:
            return 0, self.numel
        rank = self.dp_rank if dp_rank is None else dp_rank
        size = self.numel // self.dp_size
        return rank * size, (rank + 1) * size

    # --- gradient reduction --------------------------------------------------------------
    def register_grad_ready(self, param: nn.Parameter) -> None:
        """Note that `param`'s gradient is final; launch the reduction once all params are."""
        if param in self._ready or self._synced:
            raise RuntimeError(
                "a parameter's gradient became ready twice in the last micro batch; run earlier "
                "micro batches under no_sync() or call zero_grad_buffer() between steps"
            )
        self._ready.add(param)
        if len(self._ready) == len(self.params):
            self.start_grad_sync()

    def start_grad_sync(self) -> None:
        """Launch the asynchronous all-reduce (or reduce-scatter) of this bucket's gradients."""
        if self._launched or self._synced:
            return
        self._launched = True
        self._handle = self._reduce(self.grad_data)

    def _reduce(self, data: torch.Tensor):
        """Launch the reduction of `data` (this bucket's [numel] gradients), in place: scaled
        and averaged over dp, reduce-scattered into this rank's part with the distributed
        optimizer; its handle (None: nothing to wait for)."""
        if self.dp_size == 1 and self.replica_group is None:
            return None
        op = dist.ReduceOp.SUM
        if self.average_in_collective:
            op = dist.ReduceOp.AVG
        elif self.gradient_scaling_factor != 1.0:
            data.mul_(self.gradient_scaling_factor)
        start, end = self.shard_range()
        if self.replica_group is not None:
            return reduce_scatter_all_reduce(
                data[start:end], data, self.dp_group, self.replica_group, op=op,
                stream=self.comm_stream,
            )  # fmt: skip
        if self.use_distributed_optimizer:
            return reduce_scatter_flat(data[start:end], data, self.dp_group, op=op, async_op=True)
        return dist.all_reduce(data, op=op, group=self.dp_group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Wait for this bucket's reduction (launching it first if it has not started).

        A second call before `reset()` does nothing, so gradients are never reduced twice.
        """
        if self._synced:
            return
        self.start_grad_sync()
        if self._handle is not None:
            self._handle.wait()
        self._handle = None
        self._synced = True

    def reset(self) -> None:
        """Forget the last step's reduction (with the buffer zeroed: `zero_grad`)."""
        if self._handle is not None:
            self._handle.wait()  # never leave a collective behind
            self._handle = None
        self._ready.clear()
        self._launched = False
        self._synced = False

    # --- parameter gather (distributed optimizer) ----------------------------------------
    def all_gather_params(self, async_op: bool = False):
        """All-gather the updated parameter shards of every dp rank into `param_data`."""
        if not self.use_distributed_optimizer or self.dp_size == 1:
            return None
        start, end = self.shard_range()
        return all_gather_flat(
            self.param_data, self.param_data[start:end], self.dp_group, async_op=async_op
        )


class ParamAndGradBuffer:
    """The flat gradient (and, for ZeRO-1, parameter) buffer of params of one dtype."""

    def __init__(
        self,
        params: list[nn.Parameter],
        grad_dtype: torch.dtype,
        dp_group,
        *,
        bucket_size: int | None,
        use_distributed_optimizer: bool,
        gradient_scaling_factor: float,
        average_in_collective: bool,
        separate_bucket_params: set[nn.Parameter] = frozenset(),
        replica_group=None,
        comm_stream=None,
        shard_grads: bool = False,
    ):
        self.params = list(params)  # registration order
        self.param_dtype = self.params[0].dtype
        self.grad_dtype = grad_dtype
        self.dp_group = dp_group
        self.use_distributed_optimizer = use_distributed_optimizer
        separate = [p in separate_bucket_params for p in self.params]
        ranges, bucket_ranges = plan_buckets(
            [p.numel() for p in self.params],
            dp_size=dist.get_world_size(dp_group),
            bucket_size=bucket_size,
            use_distributed_optimizer=use_distributed_optimizer,
            separate=separate,
        )
        self.param_index: dict[nn.Parameter, tuple[int, int, int]] = dict(zip(self.params, ranges))
        self.numel = bucket_ranges[-1][1] if bucket_ranges else 0
        device = self.params[0].device

        dp = dist.get_world_size(dp_group)
        self.grad_data, self.grad_shard = None, None  # full buffer, or (optim_grads) the shards
        if shard_grads:
            self.grad_shard = torch.zeros(self.numel // dp, dtype=grad_dtype, device=device)
        else:
            self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data = None
        if use_distributed_optimizer:
            self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=device)
        for param, (start, end, _) in self.param_index.items():
            if self.param_data is not None:
                view = self.param_data[start:end].view(param.shape)
                view.copy_(param.data)
                param.data = view
            if self.grad_data is not None:  # (a param wrapped before may carry grad_staging)
                param.main_grad = self.grad_data[start:end].view(param.shape)
                param.__dict__.pop("grad_staging", None)

        members: list[list[nn.Parameter]] = [[] for _ in bucket_ranges]
        for param in reversed(self.params):
            members[self.param_index[param][2]].append(param)
        self.buckets: list[Bucket] = []
        for index, ((start, end), bucket_params) in enumerate(zip(bucket_ranges, members)):
            ranges = {
                p: (self.param_index[p][0] - start, self.param_index[p][1] - start)
                for p in bucket_params
            }
            make = Bucket
            if shard_grads:
                from megadyn.core.distributed.sharded_grads import ShardedGradBucket

                shard = self.grad_shard[start // dp : end // dp]
                make = functools.partial(ShardedGradBucket, grad_shard=shard, numel=end - start)
            self.buckets.append(
                make(
                    index,
                    bucket_params,
                    ranges,
                    start,
                    None if shard_grads else self.grad_data[start:end],
                    None if self.param_data is None else self.param_data[start:end],
                    dp_group,
                    use_distributed_optimizer=use_distributed_optimizer,
                    gradient_scaling_factor=gradient_scaling_factor,
                    average_in_collective=average_in_collective,
                    replica_group=replica_group,
                    comm_stream=comm_stream,
                )
            )
        self.param_to_bucket = {p: self.buckets[b] for p, (_, _, b) in self.param_index.items()}

    def start_grad_sync(self) -> None:
        for bucket in self.buckets:
            bucket.start_grad_sync()

    def finish_grad_sync(self) -> None:
        for bucket in self.buckets:
            bucket.finish_grad_sync()

    def zero_grad(self) -> None:
        (self.grad_data if self.grad_shard is None else self.grad_shard).zero_()
        for bucket in self.buckets:
            bucket.reset()

    def all_gather_params(self) -> None:
        handles = [bucket.all_gather_params(async_op=True) for bucket in self.buckets]
        for handle in handles:
            if handle is not None:
                handle.wait()
