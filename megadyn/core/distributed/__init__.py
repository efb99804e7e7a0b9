"""Data parallelism: contiguous gradient buffers, bucketed overlapped reduction, grad finalization.

`DistributedDataParallel` wraps each model chunk; `finalize_model_grads` is what the trainer
calls after the last micro batch's backward, before `optimizer.step()`.
"""

from megadyn.core.distributed.distributed_data_parallel import (
    DistributedDataParallel,
    default_bucket_size,
)
from megadyn.core.distributed.finalize_model_grads import (
    finalize_model_grads,
    tied_embedding_weight,
)
from megadyn.core.distributed.param_and_grad_buffer import (
    Bucket,
    ParamAndGradBuffer,
    plan_buckets,
)

__all__ = [
    "Bucket",
    "DistributedDataParallel",
    "ParamAndGradBuffer",
    "default_bucket_size",
    "finalize_model_grads",
    "plan_buckets",
    "tied_embedding_weight",
]
