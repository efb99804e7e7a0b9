"""A micro batch's forward and backward replayed as one CUDA graph (pp = 1, --enable-cuda-graph).

    graph = MicroBatchGraph(warmup_steps=3)
    losses = forward_backward(chunks, groups, batches, m, config=..., loss_fn=lm_loss,
                              no_sync=no_sync, cuda_graph=graph)

A training step on one stage launches some hundred kernels per layer and micro batch from
Python; with tensor parallelism each rank's collectives then wait for the rank that launched
later. Captured once, the whole micro batch (embedding, layers, loss, backward with the weight
gradients added into the DDP `main_grad` buffers, the tensor-parallel collectives) is one
graph launch, and each later micro batch only copies its tokens into the graph's inputs.

- The first `warmup_steps` calls run eagerly: kernels pick their algorithms, Triton compiles,
  NCCL connects. The next call captures and replays from then on.
- The graph is captured under `no_sync()`: the data-parallel reduction is never overlapped
  with the backward pass but launched after the last micro batch (`finalize_model_grads`), and
  the distributed optimizer's parameter all-gather is waited for before the first replay.
- It reads the parameters, the `main_grad` buffers and the batch shapes it was captured with;
  when any of them change (a rebuilt model after a layout change, another micro batch size)
  it is captured again, never replayed on stale addresses.
- A graph holds the NCCL communicators it recorded: `reset()` it before destroying their
  process groups (a process that destroys them first does not exit).
- Not capturable, refused by `check_cuda_graph`: pipeline parallelism (stages exchange
  activations between micro batches), dropout and recomputation (the tensor-parallel RNG
  tracker swaps generator states from the host), and any device other than CUDA.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch


def check_cuda_graph(*, pp: int, vpp: int, dropout: float, recompute: str | None, device) -> None:
    """Raise ValueError naming the flag that rules out --enable-cuda-graph (`device` None:
    checked later, where the device is known)."""
    if device is not None and torch.device(device).type != "cuda":
        raise ValueError("--enable-cuda-graph needs CUDA devices")
    if pp > 1 or vpp > 1:
        raise ValueError(
            "--enable-cuda-graph captures one micro batch of a single stage: it needs "
            "--pipeline-model-parallel-size 1"
        )
    if dropout > 0.0:
        raise ValueError(
            "--enable-cuda-graph needs --hidden-dropout 0 and --attention-dropout 0 (dropout "
            "swaps RNG states from the host, which a graph cannot replay)"
        )
    if recompute is not None:
        raise ValueError("--enable-cuda-graph does not combine with --recompute-granularity")


def _cuda_capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `fn` (recorded, not run); it has `replay()` and `reset()`."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


class MicroBatchGraph:
    """The captured forward and backward of one micro batch of a single-stage model chunk.

    Each step: `prepare` once (captures when needed), then `replay` per micro batch.
    `capture` (a test seam) turns a function into an object with `replay()` and `reset()`;
    by default a CUDA graph."""

    def __init__(self, warmup_steps: int = 3, capture: Callable = _cuda_capture):
        if warmup_steps < 1:
            raise ValueError(f"--cuda-graph-warmup-steps must be >= 1, got {warmup_steps}")
        self.warmup_steps, self._capture = warmup_steps, capture
        self.calls = 0  # forward_backward calls seen (eager while <= warmup_steps)
        self.captures = 0  # how often a graph was captured
        self._graph = None
        self._key: tuple | None = None
        self._inputs: dict[str, torch.Tensor] = {}
        self._loss: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None

    def begin_step(self) -> bool:
        """Count a call; whether this one replays (False: run it eagerly, warming up)."""
        self.calls += 1
        return self.calls > self.warmup_steps

    def reset(self) -> None:
        """Free the graph and its memory; the next `prepare` captures again."""
        if self._graph is not None:
            self._graph.reset()
        self._graph, self._key, self._inputs, self._loss, self._scale = None, None, {}, None, None

    def prepare(self, chunk, batch: dict, loss_fn, no_sync) -> None:
        """Once per step, before its replays: wait for the parameters (a replay runs no forward
        pre-hooks) and capture `chunk`'s forward and backward of batches shaped like `batch`
        unless the graph already holds them for the current parameters and buffers."""
        wait = getattr(chunk, "finish_param_gather", None)
        if wait is not None:
            wait()
        key = self._signature(chunk, batch, loss_fn)
        if key != self._key:
            self.reset()
            self._record(chunk, batch, loss_fn, no_sync)
            self._key = key

    def replay(self, batch: dict, scale: float) -> torch.Tensor:
        """Forward and backward of `batch` with the loss scaled by `scale` (gradients
        accumulate into `main_grad`); returns the micro batch's loss."""
        for name, static in self._inputs.items():
            static.copy_(batch[name], non_blocking=True)
        self._scale.fill_(scale)
        self._graph.replay()
        return self._loss.clone()

    @staticmethod
    def _signature(chunk, batch: dict, loss_fn) -> tuple:
        params = tuple(
            (p.data_ptr(), getattr(p, "main_grad", p).data_ptr()) for p in chunk.parameters()
        )
        shapes = tuple((k, v.shape, v.dtype) for k, v in sorted(batch.items()))
        return params, shapes, id(loss_fn)

    def _record(self, chunk, batch: dict, loss_fn, no_sync) -> None:
        self._inputs = {
            k: torch.empty_like(v, memory_format=torch.contiguous_format) for k, v in batch.items()
        }
        for name, static in self._inputs.items():
            static.copy_(batch[name])
        device = self._inputs["tokens"].device
        self._loss = torch.zeros((), dtype=torch.float32, device=device)
        self._scale = torch.ones((), dtype=torch.float32, device=device)
        inputs, loss_out, scale = self._inputs, self._loss, self._scale

        def step() -> None:
            with no_sync() if no_sync is not None else contextlib.nullcontext():
                per_token = chunk(
                    tokens=inputs["tokens"],
                    position_ids=inputs.get("position_ids"),
                    labels=inputs["labels"],
                    hidden_states=None,
                )
                loss = loss_fn(per_token, inputs)
                loss_out.copy_(loss.detach())
                (loss * scale).backward()

        self._graph = self._capture(step)
        self.captures += 1
