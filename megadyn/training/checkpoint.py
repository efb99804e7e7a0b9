"""Layout-free checkpoints through torch.distributed.checkpoint (DCP): save and load.

    <save>/iter_0000100/__*.distcp, .metadata   weights, fp32 main weights, Adam moments, RNG
    <save>/iter_0000100/megadyn.json            iteration, consumed samples, scheduler, args,
                                                the checksum of every stored item (checksums.py)
    <save>/latest_checkpointed_iteration.txt    the newest complete checkpoint (moved last)

Every tensor is stored under its global name and global shape (megadyn/models/sharding.py),
each rank writing the piece its layout holds, so a checkpoint saved under one layout loads under
any other: DCP reads each rank's new piece from whatever pieces were written. Replicas (dp
copies, the tied embedding on the last stage) are written once.

A save writes into a hidden directory and is renamed into place by rank 0 only after every
rank finished; the tracker file moves after that. A process killed mid-save leaves the previous
checkpoint as the latest. A load checks every item it reads against the recorded checksums
(a checkpoint saved before they were recorded loads unverified, and says so). Which directory
`--load` names, and whether it is complete, is checkpoint_dirs.py (its names are importable
from here too).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import torch.distributed as dist

from megadyn.core.hetero_layout import layout_to_dict
from megadyn.training import checksums
from megadyn.training.checkpoint_dirs import (
    METADATA,
    STATE_FILE,
    TRACKER,
    checkpoint_at_step,
    checkpoint_iteration,
    find_checkpoint,
    iter_dir,
    latest_checkpoint,
    missing_pieces,
    older_hint,
    required_pieces,
)
from megadyn.training.checkpoint_items import (
    OPTIM_KEYS,
    check_shapes,
    local_items,
    local_value,
    rng_items,
    set_rng_items,
)
from megadyn.training.checkpoint_reader import CheckpointError, dcp, parallel_reader

__all__ = [  # with the directory names and checks of checkpoint_dirs.py
    "METADATA",
    "STATE_FILE",
    "TRACKER",
    "CheckpointError",
    "PendingSave",
    "ReadCheckpoint",
    "apply_checkpoint",
    "checkpoint_at_step",
    "checkpoint_iteration",
    "dcp",
    "find_checkpoint",
    "iter_dir",
    "latest_checkpoint",
    "load_checkpoint",
    "missing_pieces",
    "read_checkpoint",
    "required_pieces",
    "save_checkpoint",
]


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class PendingSave:
    """A save whose files are being written; `finish()` makes it the latest checkpoint.
    Once finished, `seconds` is the time from its start and `checksum_s` the part of it that
    the slowest rank spent checksumming its files."""

    def __init__(self, root, iteration, tmp, meta, future, keep_last, group, leader):
        self.root, self.iteration, self.tmp, self.meta = root, iteration, tmp, meta
        self.future, self.keep_last, self.group = future, keep_last, group
        self.leader = leader
        self.written: tuple[dict, float] | None = None  # a synchronous save's (sums, seconds)
        self.started, self.seconds, self.checksum_s = time.perf_counter(), 0.0, 0.0

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def finish(self) -> str:
        written = self.future.result() if self.future is not None else self.written
        every: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, written, group=self.group)  # every rank's files written
        self.meta = dict(
            self.meta, **{checksums.CHECKSUMS: checksums.manifest([s for s, _ in every])}
        )
        self.checksum_s = max(seconds for _, seconds in every)
        final = iter_dir(self.root, self.iteration)
        if self.leader:
            _atomic_write(os.path.join(self.tmp, STATE_FILE), json.dumps(self.meta, indent=1))
            if os.path.exists(final):  # saved again at the same iteration: replace it
                shutil.rmtree(final)
            os.replace(self.tmp, final)
            _atomic_write(os.path.join(self.root, TRACKER), str(self.iteration))
            _prune(self.root, self.keep_last)
        dist.barrier(group=self.group)
        self.seconds = time.perf_counter() - self.started
        return final


def _prune(root: str, keep_last: int | None) -> None:
    if not keep_last:
        return
    dirs = sorted(d for d in os.listdir(root) if d.startswith("iter_"))
    for d in dirs[:-keep_last]:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def save_checkpoint(
    root,
    iteration,
    chunks,
    optimizer,
    groups,
    meta: dict,
    *,
    keep_last=None,
    async_save=False,
    group=None,
    leader: bool | None = None,
    after_write: Callable[[str], None] | None = None,
    staging: dict | None = None,
    in_host_memory: bool = False,
) -> PendingSave:
    """Write the training state of this rank; returns a `PendingSave` (finished unless async).

    `group`: the processes that write it, by default the layout's members (as a load reads it;
    in elastic mode the world also holds standby processes and ones that left the job).
    `leader`: this rank prepares and renames the directory on its file system (default: rank 0
    of `group`; several ranks when `root` is a different directory on each host).
    `after_write(tmp)` runs after this rank's files are written, before the save can finish (in
    the background thread when async; collectives in it use `group`). An asynchronous save
    writes host copies of the tensors, so training may go on meanwhile; `staging` keeps those
    host buffers (pinned on GPUs) for the next save, whose copies then start without waiting
    and are waited for by the writer thread. `in_host_memory`: `root` is in host shared memory
    (several writer threads, no fsync)."""
    items = local_items(
        chunks, groups, optimizer, device="cpu" if async_save else None, staging=staging
    )
    copied = None
    if async_save and staging is not None and next(chunks[0].parameters()).is_cuda:
        copied = torch.cuda.Event()
        copied.record()
    items.update(rng_items(groups, chunks))
    group = groups.members_group if group is None else group
    tmp = os.path.join(root, f".iter_{iteration:07d}.partial")
    leader = dist.get_rank(group) == 0 if leader is None else leader
    if leader:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that was killed
    dist.barrier(group=group)
    meta = dict(meta, iteration=iteration, layout=layout_to_dict(groups.layout))
    if async_save:
        future = _BACKGROUND.submit(_save, items, tmp, group, after_write, copied, in_host_memory)
        return PendingSave(root, iteration, tmp, meta, future, keep_last, group, leader)
    pending = PendingSave(root, iteration, tmp, meta, None, keep_last, group, leader)
    pending.written = _save(items, tmp, group, after_write, None, in_host_memory)
    pending.finish()
    return pending


HOST_MEMORY_WRITERS = 4
"""Writer threads per rank for saves into host memory (in-memory snapshots)."""
READ_THREADS = 8
"""Reader threads per rank for loads (checkpoint_reader.py)."""

_BACKGROUND = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megadyn-ckpt")


def _save(items, path, group, after_write, copied, in_host_memory: bool) -> tuple[dict, float]:
    """Write this rank's items into `path`; returns the checksums of its files and the seconds
    they took (checksums.record)."""
    if copied is not None:  # the device-to-host copies into the staging buffers
        copied.synchronize()
    if in_host_memory:  # files in shared memory: several writers, nothing to fsync
        writer = dcp().FileSystemWriter(path, sync_files=False, thread_count=HOST_MEMORY_WRITERS)
    else:
        writer = dcp().FileSystemWriter(path)
    checksums.keep_write_results(writer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp().save(items, checkpoint_id=path, storage_writer=writer, process_group=group)
    written = checksums.record(path, writer.results)
    if after_write is not None:
        after_write(path)
    return written


@dataclasses.dataclass
class ReadCheckpoint:
    """A checkpoint read into fresh tensors of this rank's layout, not yet in the model."""

    path: str
    meta: dict
    items: dict
    has_optim: bool
    rng: bool
    verified: bool = False
    """The items were checked against the checksums recorded at save (absent in older ones)."""
    seconds: float = 0.0
    checksum_s: float = 0.0
    """The part of `seconds` spent on checksums, summed over the reader threads."""


def load_checkpoint(path, chunks, optimizer, groups, *, load_optim=True, load_rng=True) -> dict:
    """Load `path` (a checkpoint dir, or a root with a tracker) into this rank's model chunks
    and optimizer under the current layout; returns the saved `megadyn.json` dict."""
    read = read_checkpoint(
        path, chunks, optimizer, groups, load_optim=load_optim, load_rng=load_rng
    )
    return apply_checkpoint(read, chunks, optimizer, groups)


def read_checkpoint(
    path, chunks, optimizer, groups, *, load_optim=True, load_rng=True, flag="--load"
):
    """Read `path` into fresh tensors shaped for this rank (the model is not touched, so this
    may run in a thread beside work on the model; its collectives use the members group),
    checking each item against the checksums recorded at save. Errors are led by `flag`, what
    named `path` (an in-memory snapshot, say)."""
    start = time.perf_counter()
    found = find_checkpoint(path, flag)
    if found is None:
        raise CheckpointError(f"{flag} {path}: no checkpoint there (no {TRACKER}, no iter_*)")
    path = found
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            meta = json.load(f)
        expected = checksums.Expected.of(meta)
        reader = parallel_reader(path, threads=READ_THREADS, expected=expected)
        metadata = reader.read_metadata()
    except (OSError, ValueError, EOFError) as e:
        raise CheckpointError(f"{flag} {path}: checkpoint is unreadable ({e})") from e
    stored = metadata.state_dict_metadata
    has_optim = load_optim and optimizer is not None and any(k.startswith("optim.") for k in stored)
    items = local_items(chunks, groups, optimizer if has_optim else None, empty=True)
    check_shapes(path, items, stored)
    rng = rng_items(groups, chunks, empty=True) if load_rng else {}
    rng = {k: v for k, v in rng.items() if k in stored and tuple(stored[k].size) == tuple(v.shape)}
    items.update(rng)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp().load(items, storage_reader=reader, process_group=groups.members_group)
    except (Exception, dcp().api.CheckpointException) as e:  # DCP wraps file errors per rank
        # every rank gets every rank's failure: each says the same
        failures = sorted(getattr(e, "failures", {0: (e, None)}).items())
        damaged = next((x for _, (x, _) in failures if isinstance(x, CheckpointError)), None)
        if damaged is not None:  # the reader named the file (and left torch's message out)
            hint = older_hint(path) if flag == "--load" else ""
            raise CheckpointError(f"{flag} {path}: {damaged}.{hint}") from None
        said = "; ".join(
            f"rank {rank}: {type(x).__name__}: {(str(x).splitlines() or [''])[0]}"
            for rank, (x, _) in failures
        )
        raise CheckpointError(f"{flag} {path}: reading the checkpoint failed ({said})") from e
    seconds = time.perf_counter() - start
    return ReadCheckpoint(
        path, meta, items, has_optim, bool(rng), expected is not None, seconds, reader.checksum_s
    )


def apply_checkpoint(read: ReadCheckpoint, chunks, optimizer, groups) -> dict:
    """Put what `read_checkpoint` read into the model, optimizer and RNG streams."""
    meta = read.meta
    _apply(read.items, chunks, optimizer if read.has_optim else None, meta)
    if optimizer is not None and not read.has_optim:
        optimizer.reload_model_params()
    if read.rng:
        set_rng_items(groups, chunks, read.items)
    meta["rng_restored"] = read.rng
    meta["optim_restored"] = read.has_optim
    return meta


@torch.no_grad()
def _apply(items, chunks, optimizer, meta) -> None:
    # the optimizer's step count and loss scaler are TrainingState (Trainer.adopt)
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            param.copy_(local_value(items[f"model.{name}"]).reshape(param.shape))
            if optimizer is not None:
                state = {
                    k: local_value(items[f"optim.{name}.{k}"]).reshape(param.shape)
                    for k in OPTIM_KEYS
                }
                optimizer.load_param_state(param, state)
