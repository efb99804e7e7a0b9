"""What every schedule does to one micro batch: draw it, run a chunk forward, hold, backward.

    steps = MicroBatchSteps(chunks, groups, batches, num_microbatches, config=..., loss_fn=...)
    y = steps.forward(c, x)          # chunk c on its next micro batch; y goes to the next stage
    grad_x = steps.backward(c, grad_y)   # oldest held micro batch of chunk c
    losses = steps.finish()          # asserts that nothing is left over

The schedules (schedules.py, interleaved.py) only decide the order of these calls and the
communication between them; they hold no tensors themselves.

A batch is a dict of [b, s] tensors: `tokens`, `position_ids`, `labels`, `loss_mask` (and
`document_ids` [b, S] under --reset-attention-mask, kept whole under cp; `cp_placement` under
--cp-placement dynamic, passed to every chunk). Every
pipeline rank draws every micro batch from its iterator (in order, once) and, under context
parallelism, keeps its cp rank's part of each sequence (context_parallel's `split_batch`); the
first virtual
stage reads `tokens` / `position_ids`, the last computes `loss_fn(per_token_loss, batch)`, whose
value divided by the number of micro batches is what is back-propagated, so gradients are the
mean over micro batches.

Chunks are called as `chunk(tokens=, position_ids=, labels=, hidden_states=, document_ids=)` (megadyn's
`GPTModel` contract): the last virtual stage returns per-token loss [b, s], others hidden
states [s(/tp), b, h].
"""

from __future__ import annotations

import weakref
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator

import torch
from torch.autograd import Variable

from megadyn.core.context_parallel import split_batch, split_batch_dynamic
from megadyn.core.pipeline.config import PipelineConfig
from megadyn.core.pipeline.p2p import P2PCommunicator

LossFn = Callable[[torch.Tensor, dict], torch.Tensor]


@dataclass
class ScheduleStats:
    """Measurements of one run of a schedule on this rank (for tests and logging)."""

    bytes_sent: int = 0
    """Bytes this rank sent to other pipeline stages."""
    peak_live_microbatches: int = 0
    """Most micro-batch forward graphs alive at once on this rank (all chunks together)."""


class LiveGraphs:
    """Counts forward outputs still alive: a micro batch's activations live exactly as long as
    its output tensor (its graph) is referenced; weak references see when it is dropped."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []
        self.peak = 0

    def add(self, output: torch.Tensor) -> None:
        self._refs = [ref for ref in self._refs if ref() is not None]
        self._refs.append(weakref.ref(output))
        self.peak = max(self.peak, len(self._refs))


class MicroBatches:
    """The micro batches of one step, drawn in order and dropped when the last chunk is done;
    each cut to cp rank `cp_rank`'s part of its sequences (all of them with cp_size 1): the
    static split, or with `cp_block_size` the micro batch's dynamic placement."""

    def __init__(
        self,
        batches: Iterator[dict],
        device,
        cp_rank: int = 0,
        cp_size: int = 1,
        cp_block_size: int | None = None,
        cp_balance: bool = True,
    ):
        self._iterator, self._device = batches, device
        self._cp_rank, self._cp_size, self._cp_block_size = cp_rank, cp_size, cp_block_size
        self._cp_balance = cp_balance
        self._drawn: dict[int, dict] = {}
        self._next = 0

    def get(self, index: int) -> dict:
        while self._next <= index:
            batch = next(self._iterator)
            if self._cp_block_size is not None and self._cp_size > 1:
                # placed where the loader made it (the CPU): the ids are read there, no sync
                batch = split_batch_dynamic(
                    batch, self._cp_rank, self._cp_size, self._cp_block_size, self._cp_balance
                )
                placement = batch.pop("cp_placement")
                batch = {k: v.to(self._device) for k, v in batch.items()}
                batch["cp_placement"] = placement
            else:
                batch = {k: v.to(self._device) for k, v in batch.items()}
                batch = split_batch(batch, self._cp_rank, self._cp_size)
            self._drawn[self._next] = batch
            self._next += 1
        return self._drawn[index]

    def release(self, index: int) -> None:
        self._drawn.pop(index)

    def __len__(self) -> int:
        return len(self._drawn)


def backward_through(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Back-propagate `grad` from `output`, which may have been deallocated once sent (data of
    one element): the engine is called directly, since `torch.autograd.backward` checks the
    gradient against the output's current shape; the graph still knows the real one."""
    Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


class MicroBatchSteps:
    """Forward and backward steps of this rank's chunks, with the tensors held in between."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        groups,
        batches: Iterator[dict],
        num_microbatches: int,
        *,
        config: PipelineConfig,
        loss_fn: LossFn,
        forward_only: bool = False,
        no_sync: Callable[[], ContextManager] | None = None,
        loss_scale: float = 1.0,
    ):
        if num_microbatches < 1:
            raise ValueError(f"number of micro batches must be >= 1, got {num_microbatches}")
        self.chunks, self.groups, self.config = chunks, groups, config
        self.num_microbatches, self.loss_fn = num_microbatches, loss_fn
        self.forward_only, self.no_sync = forward_only, no_sync
        self.loss_scale = loss_scale  # fp16: the loss is multiplied by it before backward
        device = next(chunks[0].parameters()).device
        self.data = MicroBatches(
            batches,
            device,
            groups.cp_rank,
            groups.cp_size,
            config.cp_block_size,
            config.cp_balance,
        )
        b, s = self.data.get(0)["tokens"].shape
        tp = groups.tp_size if groups.layout.sequence_parallel else 1
        shape = (s // tp, b, config.hidden_size)  # [s(/tp), b, h]
        self.comm = P2PCommunicator(groups, config, shape, device)
        self.held: list[deque] = [deque() for _ in chunks]  # (input, output) awaiting backward
        self.forwards, self.backwards = [0] * len(chunks), [0] * len(chunks)
        self.losses: list[torch.Tensor] = []
        self.live = LiveGraphs()

    def is_last_stage(self, c: int) -> bool:
        return self.groups.is_last_stage and c == len(self.chunks) - 1

    def forward(self, c: int, x: torch.Tensor | None) -> torch.Tensor | None:
        """Run chunk `c` on its next micro batch; return the activation for the next stage
        (None on the last stage, where the loss is recorded instead)."""
        index = self.forwards[c]
        self.forwards[c] += 1
        batch = self.data.get(index)
        last = self.is_last_stage(c)
        with torch.no_grad() if self.forward_only else nullcontext():
            output = self.chunks[c](
                tokens=batch["tokens"],
                position_ids=batch.get("position_ids"),
                labels=batch["labels"] if last else None,
                hidden_states=x,
                document_ids=batch.get("document_ids"),
                **({"cp_placement": batch["cp_placement"]} if "cp_placement" in batch else {}),
            )
            if last:
                loss = self.loss_fn(output, batch)  # scalar: this micro batch's loss
                self.losses.append(loss.detach())
                output = self.scaled(loss)
        if c == len(self.chunks) - 1:
            self.data.release(index)
        if not self.forward_only:
            self.held[c].append((x, output))
            self.live.add(output)
        return None if last else output

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """What is back-propagated for a micro batch's loss: its share of the mean over micro
        batches, times the fp16 loss scale."""
        if self.loss_scale == 1.0:
            return loss / self.num_microbatches
        return loss * (self.loss_scale / self.num_microbatches)

    def backward(self, c: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Back-propagate chunk `c`'s oldest held micro batch; return the gradient of its input
        (None on the first stage). Runs under `no_sync` but for the chunk's last micro batch."""
        x, output = self.held[c].popleft()
        self.backwards[c] += 1
        last_of_chunk = self.backwards[c] == self.num_microbatches
        with nullcontext() if last_of_chunk or self.no_sync is None else self.no_sync():
            if grad is None:
                assert output.numel() == 1, "only the last stage's loss has no incoming gradient"
                grad = torch.ones_like(output)
            backward_through(output, grad)
        return None if x is None else x.grad

    def replay(self, graph) -> None:
        """Forward and backward of the only chunk's next micro batch through `graph` (a
        prepared MicroBatchGraph, pp = 1): its loss is recorded, its gradients accumulated."""
        index = self.forwards[0]
        self.forwards[0] += 1
        self.backwards[0] += 1
        scale = self.loss_scale / self.num_microbatches
        self.losses.append(graph.replay(self.data.get(index), scale))
        self.data.release(index)

    def finish(self) -> list[torch.Tensor]:
        """Check that the schedule left nothing behind; return the micro-batch losses."""
        m = self.num_microbatches
        assert self.comm.pending == 0, f"{self.comm.pending} sends/receives still pending"
        assert all(n == m for n in self.forwards), f"forwards per chunk {self.forwards} != {m}"
        if not self.forward_only:
            assert all(n == m for n in self.backwards), f"backwards {self.backwards} != {m}"
        assert not any(self.held), "activations left without a backward"
        assert len(self.data) == 0, "micro batches drawn but not run"
        return self.losses
