"""RNG streams across a reconfiguration, through the control store.

The default stream depends on the pipeline rank, the tensor-parallel tracker's on the tensor and
pipeline rank. Before the reshard the data-parallel rank 0 of each (pp, tp) coordinate publishes
its streams; after the rebuild a new rank takes the streams of the old rank with its (pp, tp)
coordinates, and keeps freshly seeded ones when the old layout had no such rank.
"""

from __future__ import annotations

import io

import torch

from megadyn.core.layout import Layout
from megadyn.elastic.control.protocol import ReshardableTrainer


def _key(epoch: int, pp_rank: int, tp_rank: int) -> str:
    return f"rng/{epoch}/pp{pp_rank}/tp{tp_rank}"


def publish_rng(store, epoch: int, trainer: ReshardableTrainer) -> None:
    """Before reconfiguration `epoch`: this rank's streams, when it speaks for its (pp, tp)."""
    g = trainer.groups
    if g.dp_rank != 0:
        return
    buf = io.BytesIO()
    torch.save(trainer.rng_states(), buf)
    store.set(_key(epoch, g.pp_rank, g.tp_rank), buf.getvalue())


def restore_rng(store, epoch: int, trainer: ReshardableTrainer, old_layout: Layout) -> None:
    """After reconfiguration `epoch`: the streams of the old rank at this rank's (pp, tp)."""
    g = trainer.groups
    if g.pp_rank >= old_layout.pp or g.tp_rank >= old_layout.tp:
        return
    states = torch.load(io.BytesIO(store.get(_key(epoch, g.pp_rank, g.tp_rank))))
    trainer.set_rng_states(states)
