"""Communication of context parallelism, each call given its cp process group.

ring = RingExchange(cp_group)
received, pending = ring.start(kv)    # send to the next cp rank, receive from the previous
...                                   # compute while the exchange runs
ring.wait(pending)
pending = ring.exchange([a, b], to, [a_in, b_in], source)   # any pair of cp ranks
pending = exchange(cp_group, {1: [a]}, {1: [a_in], 2: [b_in]})  # several peers at once
wait(pending)

total = all_reduce_sum(local, cp_group)   # differentiable: backward all-reduces too
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RingExchange:
    """Point-to-point shifts around the cp group: each rank sends to cp rank + 1 and receives
    from cp rank - 1 (wrapping around), so after k shifts a rank holds what rank - k had."""

    def __init__(self, group) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def start(self, send: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Start shifting `send` one rank along the ring; returns the receive buffer and the
        pending work (pass it to `wait` before reading the buffer)."""
        received = torch.empty_like(send, memory_format=torch.contiguous_format)
        after, before = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        return received, self.exchange([send], after, [received], before)

    def exchange(self, sends: list, to: int, receives: list, source: int) -> list:
        """Start sending the tensors `sends` to cp rank `to` and receiving `receives` from cp
        rank `source` (every rank calls it with matching pairs); the pending work."""
        return exchange(self.group, {to: sends}, {source: receives})

    @staticmethod
    def wait(pending: list) -> None:
        wait(pending)


def exchange(group, sends: dict, receives: dict) -> list:
    """Start sending the tensors sends[r] to cp rank r and receiving receives[r] from cp rank
    r, for every r, in one batch (every rank calls it with matching pairs); returns the
    pending work, which holds the sent tensors until it is waited on."""
    ops, held = [], []
    for r, tensors in sends.items():
        peer = dist.get_global_rank(group, r)
        for t in tensors:
            held.append(t.contiguous())
            ops.append(dist.P2POp(dist.isend, held[-1], peer, group))
    for r, tensors in receives.items():
        peer = dist.get_global_rank(group, r)
        ops += [dist.P2POp(dist.irecv, t, peer, group) for t in tensors]
    return (dist.batch_isend_irecv(ops) if ops else []) + [_Held(held)]


def wait(pending: list) -> None:
    """Wait on the pending work of `exchange`."""
    for work in pending:
        work.wait()


class _Held:
    """Sent tensors kept alive in the pending list until the transfer is waited on."""

    def __init__(self, tensors: list) -> None:
        self.tensors = tensors

    def wait(self) -> None:
        pass


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the gradient of every input is the sum of the outputs' gradients
    (each rank's output feeds its own loss, and all of them depend on every input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable sum of `x` over `group` (identity for a group of None)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)
