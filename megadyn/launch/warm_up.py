"""One thrown-away step before the first real one after a restart.

with ThreadPoolExecutor(1) as pool:
    reading = pool.submit(trainer.read, path)   # the snapshot, through the gloo group
    warm_up(trainer)                             # the device groups meanwhile
"""

from __future__ import annotations

import itertools
import time

import torch

from megadyn.training.checkpoint_items import rng_items, set_rng_items
from megadyn.training.steps import gradients


def warm_up(trainer) -> None:
    """A small collective in every process group, then one step's forward and backward on
    the batch at the data cursor (the cursor does not move) with the gradients thrown away:
    the next training step then pays no communicator setup, compilation or kernel choice.
    The weights, optimizer, schedule and RNG streams are not read for anything kept, so
    this runs while a snapshot is read (snapshot_keeper.py `resume`)."""
    g, start = trainer.groups, time.perf_counter()
    rng = rng_items(g, trainer.chunks)  # dropout in the warm-up must not move the streams
    g.connect(trainer.device)
    connected = time.perf_counter()
    batch = trainer.train_loader.batch_at(trainer.train_loader.consumed_samples)
    n = trainer.microbatches.num_micro_batches(trainer.state.consumed_samples, g.dp_size)
    gradients(trainer.parts, itertools.repeat(batch), n)
    trainer.parts.zero_grads()  # thrown away
    set_rng_items(g, trainer.chunks, rng)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    if trainer.logs:
        trainer.print(
            f" warm-up: communicators {connected - start:.1f} s, forward and backward "
            f"{time.perf_counter() - connected:.1f} s",
            flush=True,
        )
