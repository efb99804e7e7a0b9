"""Point-to-point communication between pipeline stages, batched with `batch_isend_irecv`.

    comm = P2PCommunicator(groups, config, shape=(s, b, h), device=device)
    x = comm.recv_forward()                       # None on the first stage
    grad_y = comm.send_forward_recv_backward(y)   # None on the last stage
    x = comm.send_backward_recv_forward(grad_x)
    x, grad_y = comm.send_recv(send_next=y, send_prev=grad_x, recv_prev=True, recv_next=True)

Peers are the neighbours on the pipeline ring (`groups.pp_neighbor(+-1)`, global ranks, over
`groups.pp_group`): the last rank's "next" is the first rank, which is how the interleaved
schedule moves chunk c's output of the last rank to chunk c + 1 of the first. The named methods
are the plain pipeline's view (the first stage receives no activation, the last no gradient);
`send_recv` takes explicit flags.

Scatter/gather (PTD-P paper, section 4.1): without sequence parallelism the t ranks of a stage
hold the same activation [s, b, h]; each sends only its t-th of the flattened tensor to its peer
(the rank of the next stage with the same tp rank), which all-gathers the parts over tp. The
gradients going back travel the same way. With sequence parallelism activations are [s/t, b, h]
and differ over tp: they are sent whole.

Received activations are fresh leaves that require grad (so the backward fills their `.grad`);
an activation that was sent has its data freed when `deallocate_pipeline_outputs` is on (its
autograd graph stays for the backward). Every call waits for its operations: `pending` is 0
between calls, which the schedules assert at the end.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megadyn.core.distributed.comm import all_gather_flat
from megadyn.core.pipeline.config import PipelineConfig


class P2PCommunicator:
    """Sends and receives activations [s(/tp), b, h] and their gradients between stages."""

    def __init__(self, groups, config: PipelineConfig, shape: tuple[int, ...], device=None):
        self.group = groups.pp_group
        self.next_rank, self.prev_rank = groups.pp_neighbor(1), groups.pp_neighbor(-1)
        self.is_first, self.is_last = groups.is_first_stage, groups.is_last_stage
        self.shape, self.dtype, self.device = tuple(shape), config.dtype, device
        self.deallocate = config.deallocate_pipeline_outputs
        self.tp_group, self.tp_size, self.tp_rank = groups.tp_group, groups.tp_size, groups.tp_rank
        self.numel = math.prod(self.shape)
        self.split = (
            config.scatter_gather_tensors_in_pipeline
            and not groups.layout.sequence_parallel
            and self.tp_size > 1
            and self.numel % self.tp_size == 0
        )
        self.bytes_sent = 0
        """Bytes this rank has sent to other stages (the tp all-gather is not counted)."""
        self._pending: list = []

    # --- the plain pipeline's view ------------------------------------------------------------
    def recv_forward(self) -> torch.Tensor | None:
        return self.send_recv(recv_prev=not self.is_first)[0]

    def recv_backward(self) -> torch.Tensor | None:
        return self.send_recv(recv_next=not self.is_last)[1]

    def send_forward(self, output: torch.Tensor | None) -> None:
        self.send_recv(send_next=output)

    def send_backward(self, input_grad: torch.Tensor | None) -> None:
        self.send_recv(send_prev=input_grad)

    def send_forward_recv_backward(self, output: torch.Tensor | None) -> torch.Tensor | None:
        return self.send_recv(send_next=output, recv_next=not self.is_last)[1]

    def send_backward_recv_forward(self, input_grad: torch.Tensor | None) -> torch.Tensor | None:
        return self.send_recv(send_prev=input_grad, recv_prev=not self.is_first)[0]

    # --- one batched exchange with both neighbours --------------------------------------------
    def send_recv(
        self,
        *,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Send an activation to the next rank and/or a gradient to the previous one; receive
        an activation from the previous rank and/or a gradient from the next one. Returns
        (activation from prev, gradient from next), None where nothing was received."""
        from_prev = self._buffer() if recv_prev else None
        from_next = self._buffer() if recv_next else None
        # Activations first, gradients second, on every rank: with pp = 2 the previous and the
        # next rank are the same process, and messages between two ranks are matched in the
        # order they are posted (NCCL has no tags), so both ends must post in one order.
        ops = []
        if send_next is not None:
            ops.append(self._send_op(send_next, self.next_rank))
        if from_prev is not None:
            ops.append(dist.P2POp(dist.irecv, from_prev, self.prev_rank, self.group))
        if send_prev is not None:
            ops.append(self._send_op(send_prev, self.prev_rank))
        if from_next is not None:
            ops.append(dist.P2POp(dist.irecv, from_next, self.next_rank, self.group))
        if ops:
            self._pending.extend(dist.batch_isend_irecv(ops))
            self.wait()
        if send_next is not None and self.deallocate:
            deallocate(send_next)
        activation = None if from_prev is None else self._assemble(from_prev).requires_grad_()
        gradient = None if from_next is None else self._assemble(from_next)
        return activation, gradient

    def wait(self) -> None:
        for work in self._pending:
            work.wait()
        self._pending.clear()

    @property
    def pending(self) -> int:
        """Operations posted and not yet waited on."""
        return len(self._pending)

    # --- scatter / gather -----------------------------------------------------------------------
    def _send_op(self, tensor: torch.Tensor, peer: int) -> dist.P2POp:
        if tuple(tensor.shape) != self.shape:
            raise ValueError(f"sending a tensor of shape {tuple(tensor.shape)}, not {self.shape}")
        flat = tensor.detach().contiguous().view(-1)  # [s*b*h]
        if self.split:
            flat = flat.chunk(self.tp_size)[self.tp_rank]  # [s*b*h/tp], this rank's part
        self.bytes_sent += flat.numel() * flat.element_size()
        return dist.P2POp(dist.isend, flat, peer, self.group)

    def _buffer(self) -> torch.Tensor:
        numel = self.numel // self.tp_size if self.split else self.numel
        return torch.empty(numel, dtype=self.dtype, device=self.device)

    def _assemble(self, received: torch.Tensor) -> torch.Tensor:
        if self.split:
            full = torch.empty(self.numel, dtype=self.dtype, device=self.device)  # [s*b*h]
            all_gather_flat(full, received, self.tp_group)
            received = full
        return received.view(self.shape)  # [s(/tp), b, h], a leaf: no autograd history


def deallocate(output: torch.Tensor) -> None:
    """Release the data of a sent activation, keeping its autograd graph (Megatron's
    `deallocate_output_tensor`). A view is left alone: freeing it would free nothing."""
    if output._base is None:
        output.data = torch.empty((1,), device=output.device, dtype=output.dtype)
