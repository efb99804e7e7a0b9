"""What the elastic controller needs of a trainer, and nothing more.

megadyn/training/trainer.py implements it; the controller never reaches past it, so the
trainer's insides can change without the controller knowing. The layout-free scalars travel
as the JSON of megadyn/training/state.py's `TrainingState` (this package does not import the
training package, which sits above it).
"""

from __future__ import annotations

from typing import Protocol

import torch

from megadyn.core.groups import ParallelGroups
from megadyn.elastic.control.stragglers import StragglerScores
from megadyn.models.config import GPTConfig


class ReshardableTrainer(Protocol):
    groups: ParallelGroups
    """The layout it trains under now."""
    model_cfg: GPTConfig
    """The model as trained (its vocabulary is the tokenizer's)."""
    step_seconds: float | None
    """Seconds per step at the last log line (None before one)."""
    straggler_scores: StragglerScores | None
    """The last log interval's straggler verdict (control/stragglers.py), None before one or when
    no straggler reporting is on."""

    @property
    def iteration(self) -> int: ...

    def training_state_dict(self) -> dict:
        """Progress, schedule, optimizer step and loss scaler, JSON-ready."""
        ...

    def export_state(self) -> dict[str, torch.Tensor]:
        """This rank's tensors of training state by global key (reshard/description.py)."""
        ...

    def rng_states(self) -> dict[str, torch.Tensor]: ...

    def set_rng_states(self, states: dict[str, torch.Tensor]) -> None: ...

    def quiesce(self) -> None:
        """Finish what still uses the current groups (a snapshot being written, a CUDA graph)."""
        ...

    @property
    def built(self) -> bool:
        """It holds a layout's model and optimizer (not released)."""
        ...

    def salvage(self) -> tuple[dict[str, torch.Tensor], bool]:
        """A peer died: this rank's tensors (no communication) and whether they are those of
        `iteration`; then it drops every part that refers to the old groups."""
        ...

    def release(self) -> None:
        """Drop everything layout-dependent: this process leaves the layout."""
        ...

    def rebuild(self, groups: ParallelGroups, training: dict) -> None:
        """Build model chunks, optimizer and loaders for `groups` at the progress in
        `training`, weights uninitialized (they arrive through `take`)."""
        ...

    def take(self, tensors: dict[str, torch.Tensor], training: dict) -> None:
        """Adopt the resharded tensors and the layout-free scalars (after `rebuild`)."""
        ...

    def log_event(self, name: str, event: dict) -> None:
        """Report a reconfiguration to the run's trackers (W&B)."""
        ...
