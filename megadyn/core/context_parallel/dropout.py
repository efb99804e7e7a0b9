"""Attention dropout under context parallelism: masks that every run, recomputation and
resume reproduce, with no random state of its own.

    seed = call_seed(q.device)                       # one draw from the current stream
    keep = block_dropout(seed, p, rank, step, (b, n, sq, sk), device)   # [b, n, sq, sk] or None

The model calls attention inside its tensor-parallel tracker's `fork()` (the model-parallel
stream, seeded by tp and pp rank, so in the same state on every cp rank of a tp rank). Each
attention call draws one 63-bit seed from that stream on the host, with no device work to wait
for: on CUDA it mixes the stream's Philox seed and offset (host-side fields of the generator)
and moves the offset on, as a draw would; on CPU it draws from the CPU stream. The stream
advances alike on all cp ranks, so the state a checkpoint or snapshot keeps for them is one and
the same. The mask of a
block is then drawn by a generator of its own, seeded from (call seed, cp rank, ring step), so
the cp ranks' blocks get independent masks and the backward pass draws the forward's masks
again instead of keeping them. Under recomputation the tracker's stream is replayed, so the
recomputed forward draws the same seed and the same masks.

The masks are not those a cp 1 run draws (torch's attention kernels draw theirs from the
stream directly): a cp 2 run with dropout is reproducible, not equal to cp 1.
"""

from __future__ import annotations

import torch

_MIX = 0x9E3779B97F4A7C15  # an odd 64-bit constant: distinct (rank, step) give distinct seeds
_OFFSET_STEP = 4  # a CUDA generator's Philox offset moves in multiples of 4


def _splitmix64(x: int) -> int:
    """A 64-bit integer hash (splitmix64's finalizer): nearby inputs give unrelated outputs."""
    x = (x + _MIX) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)


def call_seed(device: torch.device) -> int:
    """One 63-bit seed from the current default stream of `device` (the tracker's, inside its
    fork), read on the host (module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
        seed, offset = generator.initial_seed(), generator.get_offset()
        generator.set_offset(offset + _OFFSET_STEP)
        return _splitmix64(seed ^ _splitmix64(offset)) >> 1
    return int(torch.randint(0, 2**63 - 1, (1,)).item())  # the CPU stream: no device


def block_seed(seed: int, rank: int, step: int) -> int:
    """The seed of ring step `step`'s block on cp rank `rank` (step 0 for the all-gather)."""
    return (seed + (rank * 4096 + step + 1) * _MIX) % 2**64


def block_dropout(seed: int | None, p: float, rank: int, step: int, shape, device):
    """The kept probabilities' scale for one block, 1/(1-p) where kept and 0 where dropped
    ([b, n, sq, sk], fp32); None without dropout."""
    if seed is None or p == 0.0:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(block_seed(seed, rank, step))
    keep = torch.rand(shape, generator=generator, device=device) >= p
    return keep.to(torch.float32) / (1.0 - p)
