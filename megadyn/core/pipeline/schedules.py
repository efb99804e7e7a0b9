"""Pipeline schedules: which micro batch each rank runs forward or backward, and when it talks.

    losses = forward_backward(chunks, groups, batches, num_microbatches,
                              config=PipelineConfig(hidden_size=h, dtype=dtype),
                              loss_fn=lambda loss, b: masked_mean(loss, b["loss_mask"]),
                              no_sync=no_sync)      # then finalize_model_grads, optimizer.step
    losses = forward_backward(..., forward_only=True)   # evaluation

`forward_backward` picks the schedule from the layout (`get_schedule`):
- pp = 1: gradient accumulation over the micro batches (no pipelining);
- pp > 1: 1F1B (PipeDream-Flush): warm-up forwards, steady one-forward-one-backward, cool-down
  backwards; rank i holds at most pp - i micro batches' activations;
- pp > 1 with virtual stages: interleaved 1F1B (interleaved.py).

Each returns the per-micro-batch losses (the loss function's values) on the last stage and an
empty list elsewhere; gradients accumulate in the chunks' parameters (mean over micro batches),
with every backward but each chunk's last inside `no_sync()`. Reductions across dp, tp
(sequence parallelism) and the embedding group are the caller's (`finalize_model_grads`).
"""

from __future__ import annotations

from typing import Callable, ContextManager, Iterator

import torch

from megadyn.core.layout import Layout, LayoutError, check_interleaved_microbatches
from megadyn.core.pipeline.config import PipelineConfig
from megadyn.core.pipeline.cuda_graph import MicroBatchGraph
from megadyn.core.pipeline.interleaved import forward_backward_interleaved
from megadyn.core.pipeline.steps import LossFn, MicroBatchSteps, ScheduleStats
from megadyn.core.tensor_parallel.fp8_cache import weights_fixed

Schedule = Callable[[MicroBatchSteps], list[torch.Tensor]]


def forward_backward_no_pipelining(steps: MicroBatchSteps) -> list[torch.Tensor]:
    """pp = 1: forward and backward each micro batch in turn (gradient accumulation)."""
    for _ in range(steps.num_microbatches):
        steps.forward(0, None)
        if not steps.forward_only:
            steps.backward(0, None)
    return steps.finish()


def forward_backward_graphed(steps: MicroBatchSteps, graph: MicroBatchGraph) -> list[torch.Tensor]:
    """pp = 1 with a CUDA graph: each micro batch replays the captured forward and backward
    (eagerly, as without the graph, while the graph warms up)."""
    if steps.forward_only or not graph.begin_step():
        return forward_backward_no_pipelining(steps)
    graph.prepare(steps.chunks[0], steps.data.get(0), steps.loss_fn, steps.no_sync)
    for _ in range(steps.num_microbatches):
        steps.replay(graph)
    return steps.finish()


def forward_backward_1f1b(steps: MicroBatchSteps) -> list[torch.Tensor]:
    """PipeDream-Flush 1F1B over one chunk per rank."""
    comm, m, groups = steps.comm, steps.num_microbatches, steps.groups
    warmup = m if steps.forward_only else min(groups.pp_size - groups.pp_rank - 1, m)
    steady = m - warmup

    # warm-up: forwards only, filling the pipeline
    for _ in range(warmup):
        comm.send_forward(steps.forward(0, comm.recv_forward()))

    # steady state: one forward, one backward (the oldest micro batch)
    x = comm.recv_forward() if steady else None
    for i in range(steady):
        grad_y = comm.send_forward_recv_backward(steps.forward(0, x))
        grad_x = steps.backward(0, grad_y)
        if i == steady - 1:
            comm.send_backward(grad_x)
        else:
            x = comm.send_backward_recv_forward(grad_x)

    # cool-down: the backwards of the warm-up micro batches
    for _ in range(0 if steps.forward_only else warmup):
        comm.send_backward(steps.backward(0, comm.recv_backward()))
    return steps.finish()


def get_schedule(layout: Layout) -> Schedule:
    """The schedule that runs `layout`."""
    if layout.pp == 1:
        return forward_backward_no_pipelining
    if layout.vpp > 1:
        return forward_backward_interleaved
    return forward_backward_1f1b


def forward_backward(
    chunks: list[torch.nn.Module],
    groups,
    batches: Iterator[dict],
    num_microbatches: int,
    *,
    config: PipelineConfig,
    loss_fn: LossFn,
    forward_only: bool = False,
    no_sync: Callable[[], ContextManager] | None = None,
    stats: ScheduleStats | None = None,
    cuda_graph: MicroBatchGraph | None = None,
    loss_scale: float = 1.0,
) -> list[torch.Tensor]:
    """Run one step's micro batches through this rank's chunks with the layout's schedule.

    `chunks` are this rank's model chunks, one per virtual stage (`build_gpt_chunks`);
    `batches` yields `num_microbatches` dicts of [b, s] tensors (every rank draws them all);
    `loss_fn(per_token_loss, batch)` gives a micro batch's scalar loss on the last stage;
    `no_sync()` (covering all chunks) disables data-parallel gradient reduction; what is
    back-propagated is the loss divided by `num_microbatches` and multiplied by `loss_scale`
    (fp16's loss scale; the optimizer unscales the gradients); `stats`, if given, receives
    measurements; `cuda_graph` (pp = 1 only) replays each training micro batch's forward and
    backward from a captured graph (cuda_graph.py). The weights must not change during the
    call: FP8 layers quantize each weight once for all micro batches (fp8_cache.py). Returns
    the micro-batch losses on the last stage, [] elsewhere.
    """
    layout = groups.layout
    if len(chunks) != layout.vpp:
        raise LayoutError(
            f"this rank has {len(chunks)} model chunks but the layout has {layout.vpp} virtual "
            "stages per pipeline rank (--num-layers-per-virtual-pipeline-stage)"
        )
    schedule = get_schedule(layout)
    if schedule is forward_backward_interleaved:  # before a micro batch is drawn
        check_interleaved_microbatches(num_microbatches, layout.pp)
    steps = MicroBatchSteps(
        chunks,
        groups,
        batches,
        num_microbatches,
        config=config,
        loss_fn=loss_fn,
        forward_only=forward_only,
        no_sync=no_sync,
        loss_scale=loss_scale,
    )
    if cuda_graph is not None and layout.pp > 1:
        raise LayoutError("a CUDA graph covers one stage: it needs pipeline-parallel size 1")
    with weights_fixed(chunks):  # fp8 layers quantize each weight once for all micro batches
        losses = (
            schedule(steps) if cuda_graph is None else forward_backward_graphed(steps, cuda_graph)
        )
    if stats is not None:
        stats.bytes_sent += steps.comm.bytes_sent
        stats.peak_live_microbatches = max(stats.peak_live_microbatches, steps.live.peak)
    return losses
