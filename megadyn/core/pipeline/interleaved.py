"""Interleaved 1F1B over virtual stages (PTD-P paper, section 2.2.2), in Megatron's order.

Each pipeline rank holds vpp chunks; virtual stage `c * pp + rank` is chunk c of `rank`, so an
activation goes round the ring vpp times (the last rank's chunk c feeds the first rank's chunk
c + 1). Micro batches enter in groups of pp: the k-th forward of a rank runs

    chunk  (k mod (pp * vpp)) // pp,   on that chunk's next micro batch

and the k-th backward the mirror chunk vpp - 1 - that. Rank i first runs
2 (pp - i - 1) + (vpp - 1) pp warm-up forwards (all of them when the micro batch count equals
pp), then alternates one forward and one backward, then drains the backwards. The number of
micro batches must be a multiple of pp.

Communication happens once per step with both neighbours (`send_recv`); received tensors wait
in per-chunk queues until the step that uses them.
"""

from __future__ import annotations

from collections import deque

import torch

from megadyn.core.pipeline.steps import MicroBatchSteps


def forward_backward_interleaved(steps: MicroBatchSteps) -> list[torch.Tensor]:
    """Megatron's interleaved 1F1B over `len(steps.chunks)` virtual stages per rank."""
    comm, groups = steps.comm, steps.groups
    pp, rank, vpp, m = groups.pp_size, groups.pp_rank, len(steps.chunks), steps.num_microbatches
    first, last = rank == 0, rank == pp - 1
    total = m * vpp
    if steps.forward_only or m == pp:
        warmup = total
    else:
        warmup = min(total, 2 * (pp - rank - 1) + (vpp - 1) * pp)
    steady = total - warmup
    inputs = [deque() for _ in range(vpp)]  # received activations, per chunk
    grads = [deque() for _ in range(vpp)]  # received gradients, per chunk

    def chunk(k: int, forward: bool = True) -> int:
        c = k % (pp * vpp) // pp
        return c if forward else vpp - 1 - c

    def forward(k: int) -> torch.Tensor | None:
        c = chunk(k)
        return steps.forward(c, None if first and c == 0 else inputs[c].popleft())

    def backward(k: int) -> torch.Tensor | None:
        c = chunk(k, forward=False)
        return steps.backward(c, None if last and c == vpp - 1 else grads[c].popleft())

    def exchange(y, grad_x, recv_prev: bool, to_chunk: int, recv_next: bool, grad_chunk: int):
        x, grad_y = comm.send_recv(
            send_next=y, send_prev=grad_x, recv_prev=recv_prev, recv_next=recv_next
        )
        if recv_prev:
            inputs[to_chunk].append(x)
        if recv_next:
            grads[grad_chunk].append(grad_y)

    # warm-up: forwards only; each step receives the input of the next forward, and the last
    # one the gradient of the first backward
    exchange(None, None, not first, 0, False, 0)
    for k in range(warmup):
        y = forward(k)
        recv_prev = k + 1 < total and not (first and chunk(k + 1) == 0)
        recv_next = k == warmup - 1 and not steps.forward_only and not last
        exchange(y, None, recv_prev, chunk(k + 1), recv_next, vpp - 1)

    # steady state: forward k + warmup, backward k. The first rank runs pp - 1 forwards ahead
    # of the last one, which is what it receives from; the last rank likewise for backwards.
    for k in range(steady):
        fk = k + warmup
        y = forward(fk)
        grad_x = backward(k)
        if first:
            to_chunk = chunk(fk - (pp - 1)) + 1
            recv_prev = to_chunk < vpp
        else:
            to_chunk, recv_prev = chunk(fk + 1), True
        if last:
            grad_chunk = chunk(k - (pp - 1), forward=False) - 1
            recv_next = grad_chunk >= 0
        else:
            grad_chunk, recv_next = chunk(k + 1, forward=False), True
        exchange(y, grad_x, recv_prev and k < steady - 1, to_chunk, recv_next, grad_chunk)

    # cool-down: the remaining backwards
    for k in range(steady, 0 if steps.forward_only else total):
        grad_x = backward(k)
        grad_chunk = chunk(k + 1, forward=False)
        recv_next = k + 1 < total and not (last and grad_chunk == vpp - 1)
        exchange(None, grad_x, False, 0, recv_next, grad_chunk)

    assert not any(inputs) and not any(grads), "received tensors left unused"
    return steps.finish()
