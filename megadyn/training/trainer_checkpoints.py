"""The Trainer's disk checkpoints: saving every --save-interval, and loading (--load, or a
snapshot megadyn/launch resumes from) in two halves that may run apart.

    trainer.save()                          # Trainer.train; async with --async-save
    trainer.adopt(trainer.read(path))       # = trainer.load(path); read may run in a thread

`TrainerCheckpoints` is a part of `Trainer` (megadyn/training/trainer.py), split off by
responsibility; the format and its reading are megadyn/training/checkpoint.py's.
"""

from __future__ import annotations

from megadyn.training import checkpoint as ckpt
from megadyn.training.arguments import dump_args
from megadyn.training.state import TrainingState


class TrainerCheckpoints:
    """Saving and loading checkpoints of `Trainer` (module docstring)."""

    def meta(self) -> dict:
        """What a checkpoint records beside the tensors (progress, schedule, arguments)."""
        return {**self.training_state().to_dict(), "args": dump_args(self.cfg)}

    def save(self) -> None:
        self.stragglers.timer.skip_next()  # the next step is slow for everyone
        self.finish_saves()
        self.params_ready()
        c = self.cfg.checkpoint
        meta = self.meta()
        self._pending = ckpt.save_checkpoint(
            c.save,
            self.state.iteration,
            self.chunks,
            self.optimizer,
            self.groups,
            meta,
            keep_last=c.keep_last,
            async_save=c.async_save,
        )
        if self._pending.future is None:
            self._said_saved(self._pending)
        elif self.logs:
            self.print(
                f" saving checkpoint at iteration {self.state.iteration} to {c.save}", flush=True
            )

    def finish_saves(self) -> None:
        """Wait for an asynchronous save still being written."""
        if self._pending is not None and self._pending.future is not None:
            self._pending.finish()
            self._said_saved(self._pending)
        self._pending = None

    def _said_saved(self, done: ckpt.PendingSave) -> None:
        if self.logs:
            self.print(
                f" saved checkpoint at iteration {done.iteration} to {done.root} in "
                f"{done.seconds:.2f} s (checksum_s {done.checksum_s:.2f})",
                flush=True,
            )

    def load(self, path: str) -> None:
        self.adopt(self.read(path))

    def read(self, path: str, flag: str = "--load") -> ckpt.ReadCheckpoint:
        """Read a checkpoint or snapshot for this layout without touching the model (so it may
        run in a thread beside megadyn/launch/warm_up.py); errors are led by `flag`."""
        c = self.cfg.checkpoint
        return ckpt.read_checkpoint(
            path,
            self.chunks,
            self.optimizer,
            self.groups,
            load_optim=not (c.no_load_optim or c.finetune),
            load_rng=not c.no_load_rng,
            flag=flag,
        )

    def adopt(self, read: ckpt.ReadCheckpoint) -> None:
        """Put a read checkpoint into the model, optimizer, schedule and data cursor."""
        c = self.cfg.checkpoint
        if not c.finetune and "scheduler" in read.meta:  # Megatron's rule, or a ConfigError
            saved = read.meta["scheduler"]
            read.meta["scheduler"] = self.scheduler.resume_state(saved, self.cfg.scheduler)
        meta = ckpt.apply_checkpoint(read, self.chunks, self.optimizer, self.groups)
        self.load_training_state(
            TrainingState.from_dict(meta),
            progress=not c.finetune and "state" in meta,
            optimizer=meta["optim_restored"],
        )
        if not self.logs:
            return
        if not read.verified:
            self.print(
                f" {read.path}: not verified (saved before megadyn recorded checksums)",
                flush=True,
            )
        self.print(
            f" loaded checkpoint {read.path} at iteration {self.state.iteration} "
            f"(optimizer state {'restored' if meta['optim_restored'] else 'not restored'}, "
            f"RNG {'restored' if meta['rng_restored'] else 'reseeded'}) read in "
            f"{read.seconds:.2f} s (checksum_s {read.checksum_s:.2f})",
            flush=True,
        )
