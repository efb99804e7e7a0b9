"""Data-parallel wrapper of one model chunk: gradient buffers, bucketed and overlapped reduction.

    chunk = DistributedDataParallel(chunk, groups.dp_group, overlap_grad_reduce=True)
    for i, micro_batch in enumerate(micro_batches):
        ctx = chunk.no_sync() if i < len(micro_batches) - 1 else nullcontext()
        with ctx:
            loss(chunk(micro_batch)).backward()   # grads accumulate into param.main_grad
    chunk.finish_grad_sync()                      # (finalize_model_grads does this)
    optimizer.step(); chunk.zero_grad_buffer()

A post-accumulate-grad hook on every parameter adds `param.grad` into `param.main_grad` and
drops `param.grad`. On the last micro batch (outside `no_sync()`), once every parameter of a
bucket has its gradient, the bucket's all-reduce (reduce-scatter with the distributed optimizer)
is launched asynchronously, so communication overlaps the rest of the backward pass. Gradients
are averaged over the data-parallel group.

A layer that accumulates into `main_grad` itself (fused weight-gradient kernels) sets
`param.grad_added_to_main_grad = True` and returns any gradient; it is then not added again.

Under `data_parallel_sharding_strategy="optim_grads"` (ZeRO-2, sharded_grads.py) every micro
batch's gradients are reduce-scattered at the end of its backward (no_sync() does not defer
it) and only this rank's part persists between micro batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from megadyn.core.distributed.finalize_model_grads import tied_embedding_weight
from megadyn.core.distributed.param_and_grad_buffer import Bucket, ParamAndGradBuffer
from megadyn.core.distributed.sharded_grads import STRATEGIES, StagedReduction
from megadyn.core.tensor_parallel.wgrad import accumulate, main_grad_of


def default_bucket_size(overlap_grad_reduce: bool, dp_size: int) -> int | None:
    """Gradient bucket size in elements: Megatron's max(40M, 1M x dp) when the reduction overlaps
    the backward pass, else one bucket per buffer (None). The reshard planner reads the same
    function to know which dp rank owns which optimizer elements."""
    return max(40_000_000, 1_000_000 * dp_size) if overlap_grad_reduce else None


class DistributedDataParallel(nn.Module):
    """Wraps one model chunk (virtual pipeline stage) for data-parallel training."""

    def __init__(
        self,
        module: nn.Module,
        dp_group,
        *,
        overlap_grad_reduce: bool = False,
        use_distributed_optimizer: bool = False,
        overlap_param_gather: bool = False,
        bucket_size: int | None = None,
        grad_reduce_in_fp32: bool = True,
        average_in_collective: bool = False,
        shard_group=None,
        replica_group=None,
        grad_groups: Mapping[nn.Parameter, object] | None = None,
        data_parallel_sharding_strategy: str = "optim",
    ):
        """Build the buffers of `module`'s trainable params and register the gradient hooks.

        `bucket_size` (elements) defaults to max(40M, 1M x dp) with `overlap_grad_reduce` and to
        one bucket per buffer without. `average_in_collective` averages with ReduceOp.AVG
        instead of scaling by 1/dp before a sum. `overlap_param_gather` (distributed optimizer)
        leaves the all-gather of updated params running after the optimizer step; each module
        waits for its params' buckets just before its next forward.

        With several distributed-optimizer instances (--num-distributed-optimizer-instances),
        `shard_group` is this rank's instance (the part of `dp_group` the optimizer state is
        sharded over) and `replica_group` the ranks of the other instances holding the same
        shard; by default the optimizer is sharded over all of `dp_group`.

        Replicas of different pipeline depth (megadyn/core/hetero_groups.py) pass
        `grad_groups`: the group each parameter's gradient is summed over instead of
        `dp_group` (the ranks holding its layer range in every replica), and the group its
        optimizer state is sharded over with the distributed optimizer; one buffer per group.
        `dp_group` is then the replica's own (size 1): gradients are summed, not averaged.

        `data_parallel_sharding_strategy` "optim_grads" (with the distributed optimizer) keeps
        only this rank's part of the gradients between micro batches (sharded_grads.py).
        """
        super().__init__()
        self.module = module
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self.overlap_param_gather = overlap_param_gather and use_distributed_optimizer
        self._gathers: dict[Bucket, object] = {}  # bucket -> its running parameter all-gather
        self._gather_hooks: list = []
        if bucket_size is None:
            bucket_size = default_bucket_size(overlap_grad_reduce, self.dp_size)
        self.bucket_size = bucket_size
        self.is_last_microbatch = True
        if shard_group is None or not use_distributed_optimizer:
            shard_group = dp_group
        if replica_group is not None:
            sizes = dist.get_world_size(shard_group) * dist.get_world_size(replica_group)
            if not use_distributed_optimizer or sizes != self.dp_size:
                raise ValueError(
                    "--num-distributed-optimizer-instances needs --use-distributed-optimizer, "
                    f"and instances x ranks per instance ({sizes}) equal to the data-parallel "
                    f"size ({self.dp_size})"
                )
        if data_parallel_sharding_strategy not in STRATEGIES:
            raise ValueError(
                f"unknown data-parallel sharding strategy {data_parallel_sharding_strategy!r}"
            )
        self.shard_grads = data_parallel_sharding_strategy == "optim_grads"
        if self.shard_grads and (not use_distributed_optimizer or grad_groups is not None):
            raise ValueError(
                "--data-parallel-sharding-strategy optim_grads needs --use-distributed-optimizer "
                "(and does not run with --heterogeneous-pipelines yet)"
            )
        comm_stream = None
        first = next(module.parameters(), None)
        if replica_group is not None and first is not None and first.is_cuda:
            comm_stream = torch.cuda.Stream(first.device)  # the reduce-scatter, then all-reduce

        if grad_groups is not None and replica_group is not None:
            raise ValueError(
                "--num-distributed-optimizer-instances does not run with replicas of "
                "different pipeline depth"
            )
        # one buffer per (param dtype, grad dtype, group): in registration order within each
        params_by_key: dict[tuple, list[nn.Parameter]] = {}
        for param in module.parameters():
            if not param.requires_grad:
                continue
            grad_dtype = torch.float32 if grad_reduce_in_fp32 else param.dtype
            group = shard_group if grad_groups is None else grad_groups[param]
            params_by_key.setdefault((param.dtype, grad_dtype, group), []).append(param)
        separate = set()
        tied = tied_embedding_weight(module)
        if use_distributed_optimizer and tied is not None:
            separate.add(tied)
        self.buffers: list[ParamAndGradBuffer] = [
            ParamAndGradBuffer(
                params,
                grad_dtype,
                group,
                bucket_size=bucket_size,
                use_distributed_optimizer=use_distributed_optimizer,
                gradient_scaling_factor=1.0 / self.dp_size,
                average_in_collective=average_in_collective,
                separate_bucket_params=separate,
                replica_group=replica_group,
                comm_stream=comm_stream,
                shard_grads=self.shard_grads,
            )
            for (_, grad_dtype, group), params in params_by_key.items()
        ]
        self._param_to_bucket: dict[nn.Parameter, Bucket] = {}
        for buffer in self.buffers:
            self._param_to_bucket.update(buffer.param_to_bucket)
        self._staging = None  # optim_grads: the per-micro-batch reductions
        if self.shard_grads:
            buckets = [b for buffer in self.buffers for b in buffer.buckets]
            self._staging = StagedReduction(buckets, overlap_grad_reduce)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._param_to_bucket
        ]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        """The wrapped module's state dict (no `module.` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)

    # --- gradient hooks -------------------------------------------------------------------
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if param.grad is not None:
            if not getattr(param, "grad_added_to_main_grad", False):
                accumulate(main_grad_of(param), param.grad)
            param.grad = None
        param.grad_added_to_main_grad = False
        if self._staging is not None:  # optim_grads: every micro batch, under no_sync too
            self._staging.grad_ready(self._param_to_bucket[param], param)
        elif self.overlap_grad_reduce and self.is_last_microbatch:
            self._param_to_bucket[param].register_grad_ready(param)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (all but the last micro batch)."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    # --- synchronisation --------------------------------------------------------------------
    def start_grad_sync(self) -> None:
        """Launch the reduction of every bucket not yet launched (non-overlapped mode)."""
        for buffer in self.buffers:
            buffer.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Wait until every bucket's gradients are averaged over data parallelism.

        Without the distributed optimizer every `main_grad` then holds the dp-averaged gradient;
        with it, only the part of each bucket this dp rank owns does.
        """
        self.start_grad_sync()
        for buffer in self.buffers:
            buffer.finish_grad_sync()

    def zero_grad_buffer(self) -> None:
        """Zero every `main_grad` (and drop `param.grad`) before the next step's first backward."""
        for param in self._param_to_bucket:
            param.grad = None
            param.grad_added_to_main_grad = False
        for buffer in self.buffers:
            buffer.zero_grad()
        if self._staging is not None:
            self._staging.reset()

    def all_gather_params(self) -> None:
        """Distributed optimizer: gather every dp rank's updated parameter shard into the params
        (left running under `overlap_param_gather`, see `finish_param_gather`)."""
        if not self.overlap_param_gather:
            for buffer in self.buffers:
                buffer.all_gather_params()
            return
        self.finish_param_gather()
        for buffer in self.buffers:  # buckets were planned in backward order: launch the
            for bucket in reversed(buffer.buckets):  # first layers' buckets first
                handle = bucket.all_gather_params(async_op=True)
                if handle is not None:
                    self._gathers[bucket] = handle
        if not self._gathers:
            return
        for module in self.module.modules():
            if any(p in self._param_to_bucket for p in module.parameters(recurse=False)):
                self._gather_hooks.append(module.register_forward_pre_hook(self._wait_for_params))

    def _wait_for_params(self, module: nn.Module, args) -> None:
        for param in module.parameters(recurse=False):
            handle = self._gathers.pop(self._param_to_bucket.get(param), None)
            if handle is not None:
                handle.wait()
        if not self._gathers:  # everything arrived: the hooks have done their work
            self.finish_param_gather()

    def finish_param_gather(self) -> None:
        """Wait for every running parameter all-gather (before params are read outside a
        forward pass: checkpoints, resharding) and drop the waiting hooks."""
        for handle in self._gathers.values():
            handle.wait()
        self._gathers.clear()
        for hook in self._gather_hooks:
            hook.remove()
        self._gather_hooks.clear()

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (before the chunk is dropped or rewrapped)."""
        self.finish_param_gather()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
