"""RNG streams for dropout under tensor parallelism, kept in an object (no globals).

Megatron's rules: dropout on activations that are replicated over tp (hidden dropout without
sequence parallelism) uses the default generator, seeded identically on every tp rank, so the
masks agree; dropout on activations that are split over tp (attention probabilities of this
rank's heads; hidden states under sequence parallelism) runs inside `tracker.fork()`, a stream
seeded differently on every tp rank.

    tracker = RNGTracker.create(seed, tp_rank, pp_rank, device)
    with tracker.fork():
        probs = F.dropout(probs, p)

The tracker's state is part of the training state (checkpoints, recomputation).
"""

from __future__ import annotations

import contextlib

import torch

_TP_SEED_OFFSET = 2718  # Megatron's offset for the model-parallel stream


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def seed_default_generator(seed: int, pp_rank: int, device: torch.device) -> None:
    """Seed the default generator the same on all tp and dp ranks of a pipeline stage."""
    s = seed + 100 * pp_rank
    torch.manual_seed(s)
    if device.type == "cuda":
        torch.cuda.manual_seed(s)


class RNGTracker:
    """Named RNG states that can be forked into and out of."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    @classmethod
    def create(cls, seed: int, tp_rank: int, pp_rank: int, device) -> RNGTracker:
        tracker = cls(device)
        tracker.add("model-parallel-rng", seed + _TP_SEED_OFFSET + tp_rank + 100 * pp_rank)
        return tracker

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = _get_state(self.device)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state(self.device)
        _set_state(saved, self.device)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        saved = _get_state(self.device)
        _set_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(saved, self.device)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}
