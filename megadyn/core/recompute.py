"""Activation recomputation, as Megatron's --recompute-granularity/--recompute-method.

    full, uniform:  the layers of a chunk are checkpointed in groups of `num_layers`
    full, block:    the first `num_layers` layers of a chunk are checkpointed one by one
    selective:      only the core attention (softmax(QK^T)V) of every layer is recomputed

Recomputation replays the RNG: the default generator (torch.utils.checkpoint does that) and
the tensor-parallel streams of the RNG tracker, so dropout masks are the same both times.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

from torch.utils.checkpoint import checkpoint as torch_checkpoint

from megadyn.core.tensor_parallel.random import RNGTracker


@dataclass(frozen=True)
class RecomputeConfig:
    granularity: str | None = None
    """None, 'full' or 'selective' (--recompute-granularity)."""
    method: str | None = None
    """'uniform' or 'block' for full recomputation (--recompute-method)."""
    num_layers: int | None = None
    """Layers per group (uniform) or layers recomputed per chunk (block) (--recompute-num-layers)."""

    def __post_init__(self) -> None:
        if self.granularity not in (None, "full", "selective"):
            raise ValueError(
                f"--recompute-granularity must be 'full' or 'selective', got {self.granularity!r}"
            )
        if self.granularity == "full":
            if self.method not in ("uniform", "block"):
                raise ValueError(
                    "--recompute-granularity full needs --recompute-method uniform or block"
                )
            if not self.num_layers or self.num_layers < 1:
                raise ValueError("--recompute-granularity full needs --recompute-num-layers >= 1")
        elif self.method is not None:
            raise ValueError("--recompute-method is only valid with --recompute-granularity full")

    @property
    def selective(self) -> bool:
        return self.granularity == "selective"


_checkpointed = threading.local()


def inside_recompute() -> bool:
    """Whether `recompute`'s function is running (its forward or its recomputation): what it
    saves for the backward is the checkpoint's to keep or drop."""
    return getattr(_checkpointed, "depth", 0) > 0


def _marked(fn):
    def run(*args):
        _checkpointed.depth = getattr(_checkpointed, "depth", 0) + 1
        try:
            return fn(*args)
        finally:
            _checkpointed.depth -= 1

    return run


def recompute(fn, *args, tracker: RNGTracker | None = None):
    """Run `fn(*args)` without keeping its activations; recompute them during backward."""

    def context_fn():
        if tracker is None:
            return contextlib.nullcontext(), contextlib.nullcontext()
        snapshot = tracker.get_states()

        @contextlib.contextmanager
        def replay():
            current = tracker.get_states()
            tracker.set_states(snapshot)
            try:
                yield
            finally:
                tracker.set_states(current)

        return contextlib.nullcontext(), replay()

    return torch_checkpoint(_marked(fn), *args, use_reentrant=False, context_fn=context_fn)


def run_layers(layers, x, config: RecomputeConfig, tracker: RNGTracker | None, **kw):
    """Apply `layers` in order to hidden states `x`, recomputing as `config` says."""
    if config.granularity != "full" or not x.requires_grad:
        for layer in layers:
            x = layer(x, **kw)
        return x

    def span(start, end):
        def fn(h):
            for layer in layers[start:end]:
                h = layer(h, **kw)
            return h

        return fn

    n = len(layers)
    if config.method == "uniform":
        for start in range(0, n, config.num_layers):
            x = recompute(span(start, min(start + config.num_layers, n)), x, tracker=tracker)
    else:  # block
        for i in range(n):
            fn = span(i, i + 1)
            x = recompute(fn, x, tracker=tracker) if i < config.num_layers else fn(x)
    return x
