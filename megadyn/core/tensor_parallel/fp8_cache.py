"""A layer's fp8 weight, quantized once per training step and reused by its micro batches.

    with weights_fixed(chunks):          # forward_backward: the micro batches of one step
        ...                              # each fp8 layer quantizes its weight on first use
                                         # (amax, tp all-reduce, cast, transposed copy), then
                                         # every later forward and backward of the step reuses it

Weights change only between steps (the optimizer's update and parameter all-gather, a
checkpoint load, a live reshard's adopt), never inside `forward_backward`, so a copy made in
the scope is valid for the whole scope; leaving the scope (also by an exception) drops it.
Outside any scope nothing is kept and every call quantizes, as without the cache.

Inside the scope an entry is also checked against the weight's address and version counter,
so an autograd-visible in-place change of a weight during a step quantizes it again. The
counter alone could not replace the scope: under the distributed optimizer a parameter is a
view of its bucket's buffer, and the all-gather that writes the updated weights into the
buffer leaves the parameter's counter as it was.

CUDA graph capture bypasses the cache (nothing read or stored): a captured micro batch
quantizes its weights in each replay. Under --enable-cuda-graph the trainer turns the caches
off (layout_parts.py): they would serve the eager warm-up steps alone and raise the job's
peak (0.9 GiB on a 1.5B Llama at one GPU, at the same tokens/s, measured while the
tensorwise backward still kept its own fp8 W^T). Memory: W and W^T in fp8, 2 bytes per
weight element held for the step, by which the step's peak grows: without the cache no
recipe keeps an fp8 W^T per micro batch in flight (tensorwise casts it again in the backward
at the forward's scale, rowwise re-quantizes W). The tensorwise backward takes the W^T that
the forward's cast wrote into the cache.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class WeightCache:
    """One layer's quantized weights by purpose ('tensorwise', 'rowwise', ...), kept while a
    `weights_fixed` scope is open. `fills` and `hits` count the quantizations done and saved;
    `enabled` False quantizes at every use (tools/bench_gpt.py --no-fp8-weight-cache)."""

    def __init__(self) -> None:
        self.enabled = True
        self.depth = 0
        self.entries: dict[str, tuple[tuple[int, int], Any]] = {}
        self.fills = 0
        self.hits = 0

    def open(self) -> None:
        self.depth += 1

    def close(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.entries.clear()

    def keeps(self, weight: torch.Tensor) -> bool:
        """Whether `get` keeps what it computes for `weight`: inside a scope, enabled, not
        capturing a CUDA graph."""
        return self.depth > 0 and self.enabled and not _capturing(weight)

    def get(
        self,
        key: str,
        weight: torch.Tensor,
        compute: Callable[[], Any],
        usable: Callable[[Any], bool] = lambda value: True,
    ) -> Any:
        """`compute()`, or inside a scope the value it gave for `key` and this weight
        (same address and version) when `usable(value)` (e.g. it holds the transpose)."""
        if not self.keeps(weight):
            return compute()
        stamp = (weight.data_ptr(), weight._version)
        entry = self.entries.get(key)
        if entry is not None and entry[0] == stamp and usable(entry[1]):
            self.hits += 1
            return entry[1]
        value = compute()
        self.entries[key] = (stamp, value)
        self.fills += 1
        return value


def weight_caches(chunks) -> list[WeightCache]:
    """The fp8 weight caches of every layer of `chunks` (modules, DDP wrappers included)."""
    caches = []
    for chunk in chunks:
        for module in chunk.modules():
            cache = getattr(getattr(module, "fp8", None), "weight_cache", None)
            if isinstance(cache, WeightCache):
                caches.append(cache)
    return caches


@contextlib.contextmanager
def weights_fixed(chunks):
    """Inside: the fp8 layers of `chunks` quantize each weight once and reuse it (the weights
    must not change: one step's forward and backward passes). Scopes nest."""
    caches = weight_caches(chunks)
    for cache in caches:
        cache.open()
    try:
        yield
    finally:
        for cache in caches:
            cache.close()
