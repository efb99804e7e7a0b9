"""Sharded gradients (ZeRO-2): --data-parallel-sharding-strategy optim_grads.

With the distributed optimizer's default strategy ("optim", ZeRO-1) every rank keeps a
full-size gradient buffer and reduce-scatters its buckets after the last micro batch. Under
"optim_grads" a rank keeps only its data-parallel part of the gradients between micro batches:
the buffer's `grad_shard`, the concatenation of the part of every bucket this rank owns, laid
out exactly as the distributed optimizer's shards (the same `plan_buckets` layout, so the
optimizer, the reshard planner and checkpoints see no difference).

A bucket's full gradients exist only while one micro batch's backward produces them:

1. staging: the first time a layer or the gradient hook asks for a parameter's gradient
   (`main_grad_of(param)`, megadyn/core/tensor_parallel/wgrad.py), its `ShardedGradBucket`
   allocates a zeroed `staging` tensor of the bucket's size; every parameter of the bucket
   gets its `main_grad` as a view of it, for that micro batch only. Parameters carry
   `param.grad_staging` (their bucket) instead of a persistent `param.main_grad`.
2. reduction: once every parameter of the bucket has its gradient (with --overlap-grad-reduce,
   while the backward goes on) or at the end of the backward (a callback queued on autograd's
   engine by the first gradient hook), the staging is reduce-scattered over the shard group in
   place, every micro batch: `no_sync()` does not defer it under this strategy.
3. accumulation: once the next bucket is launched (or the backward ends), the rank's part of
   the staging is added into `grad_shard` and the staging is dropped. On CUDA the add is
   queued on the current stream after the collective's wait, so the caching allocator hands
   the memory to later buckets in stream order (with a side communication stream, the staging
   is recorded on it first).

Peak gradient memory is then `grad_shard` (numel / dp) plus the staging of the buckets in
flight (at most one reducing and the ones filling), instead of the full buffer. That needs
several buckets and --overlap-grad-reduce: without it a buffer is one bucket, staged whole until
the backward ends, more than ZeRO-1 holds then. The price: each micro batch reduce-scatters
the whole buffer, where ZeRO-1 reduce-scatters it once a step.

Under --enable-cuda-graph the whole of a micro batch's part (staging, reduce-scatters, the adds
into `grad_shard`) is captured with its backward: the flush runs inside the backward, the
staging comes from the graph's memory pool, and every replay adds into the same `grad_shard`,
which the step zeroes outside the graph. The Python state (which bucket is staged or launched)
ends each captured backward as it began, so eager micro batches and replays can alternate.

`ParamShard.grad()` (the optimizer) reads `shard_grad(param)`, the parameter's piece of
`grad_shard`; sequence parallelism's tp all-reduce of norm gradients works on those pieces too
(every tp rank has the same bucket layout).
"""

from __future__ import annotations

import torch
from torch import nn

from megadyn.core.distributed.param_and_grad_buffer import Bucket

STRATEGIES = ("optim", "optim_grads")


class ShardedGradBucket(Bucket):
    """A bucket whose full gradients live in a per-micro-batch `staging` tensor and whose
    persistent gradient is `grad_shard`, the part of the bucket this dp rank owns."""

    def __init__(self, *args, grad_shard: torch.Tensor, numel: int, **kwargs):
        super().__init__(*args, numel=numel, **kwargs)
        self.grad_shard = grad_shard  # [numel / dp] view of the buffer's grad_shard
        self.staging: torch.Tensor | None = None  # [numel], while a micro batch's grads exist
        self.staged = 0  # staging tensors allocated so far (tests count them)
        self.reduced = False  # this micro batch's gradients went into grad_shard
        for param in self.params:
            param.grad_staging = self
            param.__dict__.pop("main_grad", None)  # of an earlier wrapping

    # --- staging ---------------------------------------------------------------------------
    def stage(self) -> torch.Tensor:
        """The bucket's full-size gradient tensor of this micro batch (zeroed when made)."""
        if self.staging is None:
            shard = self.grad_shard
            self.staging = torch.zeros(self.numel, dtype=shard.dtype, device=shard.device)
            self.staged += 1
        return self.staging

    def main_grad(self, param: nn.Parameter) -> torch.Tensor:
        """`param`'s gradient of this micro batch, to add into (a view of the staging)."""
        start, end = self.param_ranges[param]
        return self.stage()[start:end].view(param.shape)

    def shard_grad(self, param: nn.Parameter) -> torch.Tensor:
        """The piece of `grad_shard` holding `param`'s elements that this rank owns (flat,
        possibly empty): the same range as the optimizer's `ParamShard`."""
        p_start, p_end = self.param_ranges[param]
        lo, hi = self.shard_range()
        start, end = max(p_start, lo), min(p_end, hi)
        return self.grad_shard[start - lo : end - lo] if start < end else self.grad_shard[:0]

    # --- reduction ---------------------------------------------------------------------------
    def start_grad_sync(self) -> None:
        """Launch the reduce-scatter of the staged gradients (nothing staged: nothing to do)."""
        if self._launched or self.staging is None:
            return
        self._launched = True
        self._handle = self._reduce(self.staging)

    def finish_grad_sync(self) -> None:
        """Finish the staged micro batch: wait for its reduction, add this rank's part into
        `grad_shard`, release the staging. Without staged gradients, nothing to do."""
        if self.staging is None:
            return
        self.start_grad_sync()
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        start, end = self.shard_range()
        self.grad_shard.add_(self.staging[start:end])
        if self.comm_stream is not None:
            self.staging.record_stream(self.comm_stream)
        self.staging = None
        self._ready.clear()
        self._launched = False
        self.reduced = True

    def reset(self) -> None:
        super().reset()
        self.staging, self.reduced = None, False


class StagedReduction:
    """The per-micro-batch reductions of one DDP chunk's `ShardedGradBucket`s.

    Its `grad_ready` runs in the gradient hook of every parameter. With `overlap` a bucket is
    launched once all its parameters have their gradient, and then the buckets launched before
    it are finished (waited for, accumulated, released): at most one bucket reduces while the
    next ones fill, so the staging in use stays a few buckets. The first hook of a backward
    queues `flush` on autograd's engine, which runs when that backward ends.
    """

    def __init__(self, buckets: list[ShardedGradBucket], overlap: bool):
        self.buckets, self.overlap = buckets, overlap
        self._queued = False
        self._reducing: ShardedGradBucket | None = None  # launched, not yet finished

    def grad_ready(self, bucket: ShardedGradBucket, param: nn.Parameter) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        if not self.overlap:
            return
        bucket.register_grad_ready(param)
        if bucket._launched and bucket is not self._reducing:
            if self._reducing is not None:
                self._reducing.finish_grad_sync()
            self._reducing = bucket

    def reset(self) -> None:
        """Forget a backward that never ended (it raised): its flush was not run."""
        self._queued, self._reducing = False, None

    def flush(self) -> None:
        """End of one micro batch's backward: reduce every bucket's staged gradients into the
        shards. Every bucket is reduced (one with no gradient this micro batch as zeros), so all
        ranks run the same collectives; all are launched before the first wait. Buckets
        reduced during the backward are not reduced again (unless gradients came after)."""
        self.reset()
        pending = [b for b in self.buckets if not b.reduced or b.staging is not None]
        for bucket in pending:
            bucket.stage()
            bucket.start_grad_sync()
        for bucket in pending:
            bucket.finish_grad_sync()
        for bucket in self.buckets:
            bucket.reduced = False
