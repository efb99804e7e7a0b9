"""Pipeline parallelism: point-to-point communication between stages and the schedules.

    from megadyn.core.pipeline import PipelineConfig, forward_backward
    losses = forward_backward(chunks, groups, batches, num_microbatches,
                              config=PipelineConfig(hidden_size=h, dtype=dtype), loss_fn=...)

p2p.py          batched send/receive between neighbouring stages, scatter/gather over tp
steps.py        one micro batch's forward / backward on a chunk, and what is held in between
schedules.py    no pipelining, 1F1B, `get_schedule`, `forward_backward`
cuda_graph.py   pp = 1: a micro batch's forward and backward captured and replayed
interleaved.py  interleaved 1F1B over virtual stages
"""

from megadyn.core.layout import check_interleaved_microbatches
from megadyn.core.pipeline.config import PipelineConfig
from megadyn.core.pipeline.cuda_graph import MicroBatchGraph, check_cuda_graph
from megadyn.core.pipeline.interleaved import forward_backward_interleaved
from megadyn.core.pipeline.p2p import P2PCommunicator, deallocate
from megadyn.core.pipeline.schedules import (
    forward_backward,
    forward_backward_1f1b,
    forward_backward_no_pipelining,
    get_schedule,
)
from megadyn.core.pipeline.steps import MicroBatchSteps, ScheduleStats

__all__ = [
    "MicroBatchGraph",
    "MicroBatchSteps",
    "P2PCommunicator",
    "PipelineConfig",
    "ScheduleStats",
    "check_cuda_graph",
    "check_interleaved_microbatches",
    "deallocate",
    "forward_backward",
    "forward_backward_1f1b",
    "forward_backward_interleaved",
    "forward_backward_no_pipelining",
    "get_schedule",
]
