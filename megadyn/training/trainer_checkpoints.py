"""The Trainer's disk checkpoints: saving every --save-interval, and loading (--load, or a
snapshot megadyn/launch resumes from) in two halves that may run apart.

    checkpoints = Checkpoints(print_fn)                       # one per Trainer
    checkpoints.save(cfg, parts, iteration, meta, logs)       # Trainer.save; async with --async-save
    read = checkpoints.read(cfg, parts, path)                 # may run in a thread
    meta = checkpoints.apply(cfg, parts, read, scheduler)     # then the Trainer takes the scalars

The format and its reading are megadyn/training/checkpoint.py's; the Trainer (trainer.py)
gives the layout's parts (layout_parts.py) and takes the layout-free scalars back.
"""

from __future__ import annotations

from megadyn.training import checkpoint as ckpt
from megadyn.training import checksums
from megadyn.training.config import MegadynConfig
from megadyn.training.layout_parts import LayoutParts


class Checkpoints:
    """Saving and loading checkpoints of one Trainer (module docstring)."""

    def __init__(self, print_fn=print):
        self.print = print_fn
        self.pending: ckpt.PendingSave | None = None
        """A checkpoint being saved (--async-save)."""

    def save(
        self, cfg: MegadynConfig, parts: LayoutParts, iteration: int, meta: dict, logs: bool
    ) -> None:
        self.finish(logs)
        parts.params_ready()
        c = cfg.checkpoint
        self.pending = ckpt.save_checkpoint(
            c.save,
            iteration,
            parts.chunks,
            parts.optimizer,
            parts.groups,
            meta,
            keep_last=c.keep_last,
            async_save=c.async_save,
        )
        if self.pending.future is None:
            self._said_saved(self.pending, logs)
        elif logs:
            self.print(f" saving checkpoint at iteration {iteration} to {c.save}", flush=True)

    def finish(self, logs: bool) -> None:
        """Wait for an asynchronous save still being written."""
        if self.pending is not None and self.pending.future is not None:
            self.pending.finish()
            self._said_saved(self.pending, logs)
        self.pending = None

    def _said_saved(self, done: ckpt.PendingSave, logs: bool) -> None:
        if logs:
            self.print(
                f" saved checkpoint at iteration {done.iteration} to {done.root} in "
                f"{done.seconds:.2f} s (checksum_s {done.checksum_s:.2f})",
                flush=True,
            )

    def read(
        self, cfg: MegadynConfig, parts: LayoutParts, path: str, flag: str = "--load"
    ) -> ckpt.ReadCheckpoint:
        """Read a checkpoint or snapshot for this layout without touching the model (so it may
        run in a thread beside megadyn/launch/warm_up.py); errors are led by `flag`."""
        c = cfg.checkpoint
        return ckpt.read_checkpoint(
            path,
            parts.chunks,
            parts.optimizer,
            parts.groups,
            load_optim=not (c.no_load_optim or c.finetune),
            load_rng=not c.no_load_rng,
            flag=flag,
        )

    def apply(
        self, cfg: MegadynConfig, parts: LayoutParts, read: ckpt.ReadCheckpoint, scheduler
    ) -> dict:
        """Put a read checkpoint's tensors into the model and optimizer; its metadata, the
        schedule's part checked against the command line (Megatron's rule, or a ConfigError)."""
        if not cfg.checkpoint.finetune and "scheduler" in read.meta:
            saved = read.meta["scheduler"]
            read.meta["scheduler"] = scheduler.resume_state(saved, cfg.scheduler)
        return ckpt.apply_checkpoint(read, parts.chunks, parts.optimizer, parts.groups)

    def say_loaded(self, read: ckpt.ReadCheckpoint, meta: dict, iteration: int) -> None:
        if not read.verified:
            self.print(f" {checksums.unverified(read.path)}", flush=True)
        self.print(
            f" loaded checkpoint {read.path} at iteration {iteration} "
            f"(optimizer state {'restored' if meta['optim_restored'] else 'not restored'}, "
            f"RNG {'restored' if meta['rng_restored'] else 'reseeded'}) read in "
            f"{read.seconds:.2f} s (checksum_s {read.checksum_s:.2f})",
            flush=True,
        )
