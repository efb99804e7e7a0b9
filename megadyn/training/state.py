"""The layout-free scalars of a run, in one object that every path reads and writes.

    ts = trainer.training_state()          # progress, schedule, optimizer step, loss scale
    meta = ts.to_dict()                    # a checkpoint's and a snapshot's metadata.json
    rec["training"] = ts.to_dict()         # a live reconfiguration's JSON
    trainer.load_training_state(TrainingState.from_dict(meta))

The tensors of training state (weights, fp32 main weights, Adam moments) have their layout-free
description in megadyn/elastic/reshard/description.py; the RNG streams travel per (pp, tp) coordinate
(megadyn/training/checkpoint_items.py). Everything else a run must carry across a checkpoint,
a snapshot, a live reshard or a recovery is a field here, so a value added once (the dynamic
loss scale, say) reaches every path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class TrainState:
    """Progress of the run."""

    iteration: int = 0
    consumed_samples: int = 0
    """The data cursor: global samples consumed (DESIGN section 6)."""
    skipped_iterations: int = 0
    nan_iterations: int = 0


@dataclass
class TrainingState:
    """Progress, learning-rate schedule, optimizer step count and loss scaler."""

    progress: TrainState = field(default_factory=TrainState)
    scheduler: dict = field(default_factory=dict)
    optimizer_step: int = 0
    grad_scaler: dict | None = None
    """The fp16 loss scaler's state (scale, growth and hysteresis trackers); None without one."""

    def to_dict(self) -> dict:
        """JSON-ready, under the keys a checkpoint's metadata has always used."""
        return {
            "state": dataclasses.asdict(self.progress),
            "scheduler": dict(self.scheduler),
            "optimizer_step": self.optimizer_step,
            "grad_scaler": self.grad_scaler,
        }

    @classmethod
    def from_dict(cls, d: dict) -> TrainingState:
        return cls(
            progress=TrainState(**d.get("state", {})),
            scheduler=dict(d.get("scheduler") or {}),
            optimizer_step=int(d.get("optimizer_step", 0)),
            grad_scaler=d.get("grad_scaler"),
        )
