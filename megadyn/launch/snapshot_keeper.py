"""The in-memory snapshots of one trainer, and where a (re)started job resumes from.

    keeper = SnapshotKeeper(interval)          # one per Trainer: Trainer(..., hooks=[keeper])
    keeper.after_step(trainer)                 # every step boundary: finish when agreed, and
                                               # start one every --elastic-snapshot-interval
    keeper.quiesce(trainer)                    # wait for the writers (before a reshard)
    keeper.drop(trainer)                       # the run is done: the snapshot dir goes
    resume(trainer)                            # newest complete snapshot, else --load

A snapshot is an asynchronous DCP checkpoint in this host's snapshot dir (host shared memory),
copied to a peer rank on another host by the writer thread over the gloo members group
(snapshots.py). Training does not wait for it: the host copies go into buffers kept from one
snapshot to the next, and the members agree through the store on the step boundary at which
every member's files are written (snapshots.FinishAgreement).
"""

from __future__ import annotations

import functools
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist

from megadyn.launch import snapshots, startup
from megadyn.launch.warm_up import warm_up
from megadyn.training import checkpoint as ckpt
from megadyn.training.hooks import StepHook


class SnapshotKeeper(StepHook):
    """The snapshot schedule of one trainer, run as its step hook."""

    def __init__(self, interval: int) -> None:
        self.interval = interval  # --elastic-snapshot-interval
        self.pending: ckpt.PendingSave | None = None
        self.agreement: snapshots.FinishAgreement | None = None
        self.staging: dict = {}  # host buffers, kept while the layout is

    def after_step(self, trainer) -> None:
        """Finish the running snapshot where the members agreed to; start the next one every
        `interval` iterations (not after the last)."""
        self.poll(trainer)
        it = trainer.state.iteration
        if it % self.interval == 0 and it < trainer.train_iters:
            self.start(trainer)

    def quiesce(self, trainer) -> None:
        self.finish(trainer)

    def abandon(self, trainer) -> None:
        self.pending = self.agreement = None  # its writers may wait on the dead process
        self.staging = {}

    def new_layout(self, trainer) -> None:
        self.staging = {}  # host buffers of the old layout's snapshots go

    def end(self, trainer) -> None:
        self.finish(trainer)

    def start(self, trainer) -> None:
        """Begin a snapshot of the trainer's state at its current iteration."""
        self.finish(trainer)
        trainer.params_ready()
        group = trainer.groups.members_group
        hosts = snapshots.HostMap.gather(group)
        self.pending = ckpt.save_checkpoint(
            snapshots.snapshot_root(trainer.cfg.elastic.snapshot_dir),
            trainer.state.iteration,
            trainer.chunks,
            trainer.optimizer,
            trainer.groups,
            trainer.meta(),
            keep_last=2,
            async_save=True,
            group=group,
            leader=hosts.is_leader(dist.get_rank(group)),
            after_write=functools.partial(snapshots.copy_to_peer, hosts=hosts, group=group),
            staging=self.staging,
            in_host_memory=True,
        )
        self.agreement = snapshots.FinishAgreement(
            trainer.state.iteration, trainer.groups.grid.members, dist.get_rank()
        )

    def poll(self, trainer) -> None:
        """At a step boundary: finish the running snapshot if this is the step the members
        agreed on once all their files were written; never waits for a writer."""
        if self.pending is not None and self.agreement.finish_now(
            self.pending.done(), trainer.state.iteration
        ):
            self.finish(trainer)

    def finish(self, trainer) -> None:
        """Make the running snapshot the newest complete one (waiting for its writers)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        path = pending.finish()
        if trainer.logs:
            trainer.print(
                f" in-memory snapshot {path} complete at iteration {trainer.state.iteration} "
                f"(checksum_s {pending.checksum_s:.2f})",
                flush=True,
            )

    def drop(self, trainer) -> None:
        """The run is done: every member removes its host's snapshot dir (collective over the
        members group, so that no rank still writes or reads one)."""
        self.finish(trainer)
        dist.barrier(group=trainer.groups.members_group)
        root = snapshots.snapshot_root(trainer.cfg.elastic.snapshot_dir)
        shutil.rmtree(root, ignore_errors=True)


def resume(trainer) -> None:
    """Continue from the newest in-memory snapshot whose every piece exists on some host
    (copying pieces to the hosts that lack them), else from --load; the log says which and
    why. Snapshots that exist but lack a piece everywhere, with no disk checkpoint to fall back
    to, are an error rather than a fresh start."""
    p, load = trainer.cfg.elastic, trainer.cfg.checkpoint.load
    disk = ckpt.find_checkpoint(load) if load else None
    say = trainer.print if trainer.logs else (lambda *a, **k: None)
    found, root = snapshots.Recovery(), snapshots.snapshot_root(p.snapshot_dir)
    if p.snapshot_interval:
        group = trainer.groups.members_group
        found = snapshots.plan_recovery(root, snapshots.HostMap.gather(group), group)
    usable = found.iteration is not None
    if usable and (disk is None or found.iteration >= ckpt.checkpoint_iteration(disk)):
        _load_snapshot(trainer, found, root, say)
    elif disk is not None:
        if p.snapshot_interval and not usable:
            why = "".join(f" ({line})" for line in found.passed_over(root)[:1])
            say(
                f" recovery: no complete in-memory snapshot{why}; falling back to the disk "
                f"checkpoint {disk}",
                flush=True,
            )
        trainer.load(disk)
    elif found.any_snapshot and not usable:
        raise ckpt.CheckpointError(
            f"recovery: {found.passed_over(root)[0]}, and there is no disk checkpoint "
            f"to fall back to (--load {load or 'not given'}); refusing to train from scratch"
        )
    elif load:
        say(f" --load {load}: no checkpoint found, training from scratch", flush=True)


def resume_snapshot(trainer) -> bool:
    """Load the newest complete in-memory snapshot into `trainer` (the survivors of a failure
    that no replica covers, in the same processes); False when there is none."""
    p = trainer.cfg.elastic
    if not p.snapshot_interval:
        return False
    root, group = snapshots.snapshot_root(p.snapshot_dir), trainer.groups.members_group
    found = snapshots.plan_recovery(root, snapshots.HostMap.gather(group), group)
    if found.iteration is None:
        return False
    _load_snapshot(trainer, found, root, trainer.print if trainer.logs else (lambda *a, **k: None))
    return True


def _load_snapshot(trainer, found, root: str, say) -> None:
    """Copy the pieces of snapshot `found` to the hosts that lack them and load it, reading
    beside a warm-up step."""
    path = snapshots.gather_snapshot(found, root, trainer.groups.members_group)
    startup.mark("snapshot located")
    for line in found.passed_over(root) + found.copies():
        say(f" recovery: {line}", flush=True)
    say(f" recovery: resuming from the in-memory snapshot {path}", flush=True)
    start = time.perf_counter()

    def read_snapshot():  # its collectives use the gloo members group
        return trainer.read(path, flag="recovery: in-memory snapshot"), time.perf_counter() - start

    with ThreadPoolExecutor(1, thread_name_prefix="megadyn-resume") as pool:
        reading = pool.submit(read_snapshot)
        warm_up(trainer)  # the device groups meanwhile
        loaded, seconds = reading.result()
    trainer.adopt(loaded)
    startup.mark("snapshot read beside a warm-up step")
    say(
        f" recovery: snapshot loaded in {time.perf_counter() - start:.1f} s (read in "
        f"{seconds:.1f} s beside the warm-up)",
        flush=True,
    )
