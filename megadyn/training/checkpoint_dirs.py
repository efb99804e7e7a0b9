"""Where checkpoints are and whether they are complete (the save and load paths are
checkpoint.py).

    <save>/iter_0000100/__*.distcp, .metadata   written by torch.distributed.checkpoint
    <save>/iter_0000100/megadyn.json            iteration, consumed samples, scheduler, args
    <save>/latest_checkpointed_iteration.txt    the newest complete checkpoint (moved last)

A directory counts as complete only when both marker files are there and every storage file
that `.metadata` references is present with at least the bytes the metadata places in it
(`damage`).

`--load root` resumes from the checkpoint the tracker names, or stops with a CheckpointError
that says which file is missing, short or unreadable and how to load an older one on purpose
(`--ckpt-step N`, or `--load root/iter_N`); never silently from an older one. Only without a
tracker is the newest complete iter_* directory taken.
"""

from __future__ import annotations

import json
import os
import re

from megadyn.training.checkpoint_reader import CheckpointError, dcp, why_unreadable
from megadyn.training.config import ConfigError

TRACKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "megadyn.json"
METADATA = ".metadata"
_ITER_DIR = re.compile(r"iter_(\d+)")


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def checkpoint_at_step(load: str | None, step: int) -> str:
    """The directory that `--load load --ckpt-step step` names (Megatron's --ckpt-step)."""
    if not load:
        raise ConfigError("--ckpt-step needs --load, the directory that holds the iter_* ones")
    if step < 0:
        raise ConfigError(f"--ckpt-step must be >= 0, got {step}")
    if _iteration_of(load) is not None:
        raise ConfigError(
            f"--ckpt-step: --load {load} is a checkpoint directory itself; give the directory "
            "that holds it, or leave --ckpt-step out"
        )
    return iter_dir(load, step)


def _iteration_of(path: str) -> int | None:
    """The iteration an iter_* directory's name says; None for another name."""
    m = _ITER_DIR.fullmatch(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def _iter_dirs(root: str) -> list[str]:
    """The iter_* directories under `root`, oldest first."""
    names = os.listdir(root) if os.path.isdir(root) else []
    found = [(_iteration_of(n), n) for n in names if os.path.isdir(os.path.join(root, n))]
    return [n for it, n in sorted((it, n) for it, n in found if it is not None)]


def required_pieces(path: str) -> dict[str, int] | None:
    """{storage file: least size in bytes} that the checkpoint's `.metadata` references, with
    `.metadata` itself; None when the metadata is missing or unreadable."""
    return _required(path)[0]


def _required(path: str) -> tuple[dict[str, int] | None, str]:
    """`required_pieces`, or None and what is wrong with `.metadata`."""
    if not os.path.isfile(os.path.join(path, METADATA)):
        return None, "is missing"
    try:
        metadata = dcp().FileSystemReader(path).read_metadata()
        need = {METADATA: os.path.getsize(os.path.join(path, METADATA))}
        for info in metadata.storage_data.values():
            end = info.offset + info.length
            need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    except Exception as e:  # noqa: BLE001 - whatever a damaged pickle raises
        return None, f"is unreadable: {why_unreadable(e)}"
    return need, ""


def damage(path: str) -> list[tuple[str, str]]:
    """(file, what is wrong with it) for each file of the checkpoint directory `path` that is
    missing, holds fewer bytes than `.metadata` places in it, or (the metadata files) does not
    decode; [] when the directory is complete. Same-size damage inside a storage file shows
    only when it is read (checkpoint_reader.py)."""
    need, wrong = _required(path)
    found = [(METADATA, wrong)] if need is None else []
    for name, size in sorted((need or {}).items()):
        have = _size(path, name)
        if have < 0:
            found.append((name, "is missing"))
        elif have < size:
            short = f"is short by {size - have} bytes (holds {have}; {METADATA} says {size})"
            found.append((name, short))
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            int(json.load(f)["iteration"])
    except FileNotFoundError:
        found.append((STATE_FILE, "is missing"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        found.append((STATE_FILE, f"is unreadable ({type(e).__name__}: {e})"))
    return found


def missing_pieces(path: str) -> list[str]:
    """The files of `damage(path)`: missing, short or unreadable."""
    return [name for name, _ in damage(path)]


def _size(path: str, name: str) -> int:
    try:
        return os.path.getsize(os.path.join(path, name))
    except OSError:
        return -1


def _complete(path: str) -> bool:
    return os.path.isdir(path) and not damage(path)


def _older(root: str, below: int | None, flag: str = "--load") -> str:
    """How to load, on purpose, the newest complete checkpoint under `root` older than
    iteration `below` (a sentence to end an error with); `flag` names the directory to load."""
    for name in reversed(_iter_dirs(root)):
        it = _iteration_of(name)
        if (below is None or it < below) and _complete(os.path.join(root, name)):
            path = os.path.join(root, name)
            if flag == "--load":  # pretrain_gpt.py
                how, verb = f"--ckpt-step {it} (or --load {path})", "resume from"
            else:  # a tool's own flag
                how, verb = f"{flag} {path}", "use"
            return f" To {verb} the older checkpoint of iteration {it} on purpose, give {how}."
    return f" There is no older complete checkpoint under {root}."


def older_hint(path: str, flag: str = "--load") -> str:
    """`_older` for the checkpoint directory `path`: how to load the newest complete one
    beside it that is older."""
    return _older(os.path.dirname(os.path.normpath(path)), _iteration_of(path), flag)


def _check(path: str, lead: str, gone: str, flag: str) -> None:
    """Raise a CheckpointError, led by `lead`, unless `path` is a complete checkpoint; `gone`
    says that the directory does not exist."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{lead}{gone}.{older_hint(path, flag)}")
    wrong = damage(path)
    if wrong:
        said = "; ".join(f"{os.path.join(path, name)} {what}" for name, what in wrong)
        raise CheckpointError(f"{lead}{said}.{older_hint(path, flag)}")


def latest_checkpoint(root: str, flag: str = "--load") -> str | None:
    """The checkpoint `root` resumes from: the one its tracker names, which must be complete
    (else a CheckpointError led by `flag` names what is wrong), or without a tracker the newest
    complete iter_* directory; None when there is none."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        done = [n for n in _iter_dirs(root) if _complete(os.path.join(root, n))]
        return os.path.join(root, done[-1]) if done else None
    with open(tracker) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise CheckpointError(
            f"{flag} {root}: {tracker} holds {text[:40]!r}, not an iteration.{_older(root, None, flag)}"
        )
    path = iter_dir(root, int(text))
    lead = f"{flag} {root}: {TRACKER} names iteration {int(text)}, but "
    _check(path, lead, gone=f"{path} does not exist", flag=flag)
    return path


def find_checkpoint(path: str, flag: str = "--load") -> str | None:
    """What `--load path` names: `path` itself when it is a checkpoint directory (iter_* or
    holding the marker files), else the checkpoint its tracker names, else the newest complete
    one under it; None when it holds no checkpoint at all. A checkpoint so named that is missing
    or damaged, and iter_* directories of which none is complete, are a CheckpointError."""
    if _iteration_of(path) is not None or any(
        os.path.exists(os.path.join(path, n)) for n in (METADATA, STATE_FILE)
    ):
        _check(path, f"{flag} {path}: ", gone="no such directory", flag=flag)
        return path
    found = latest_checkpoint(path, flag)
    dirs = _iter_dirs(path)
    if found is None and dirs:
        newest = os.path.join(path, dirs[-1])
        lead = f"{flag} {path}: no complete checkpoint under it (and no {TRACKER}); "
        _check(newest, lead, gone=f"{newest} is gone", flag=flag)
    return found


def checkpoint_iteration(path: str) -> int:
    """The iteration a complete checkpoint directory was saved at; -1 when unreadable."""
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            return int(json.load(f)["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1
