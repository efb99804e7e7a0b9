"""Write files under temporary names and rename them into place only on success.

Every writer in `megadyn.data` (indexed datasets, cached indices, tokenizer models, the default
corpus) goes through these helpers, so a crash or a bad input never leaves a partial output file
under its final name: readers see either nothing or the whole file.

    with atomic_outputs(["out.bin", "out.idx"]) as (tmp_bin, tmp_idx):
        ...write tmp_bin and tmp_idx...
    # renamed to out.bin / out.idx here; removed if the block raised
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator, Sequence

import numpy as np

TMP_MARKER = ".tmp-"


def temporary_name(path: str) -> str:
    """A unique sibling of `path` (same directory, so the final rename is atomic)."""
    return f"{path}{TMP_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_quietly(path: str) -> None:
    """Delete `path` if it exists."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


@contextlib.contextmanager
def atomic_outputs(paths: Sequence[str]) -> Iterator[list[str]]:
    """Yield temporary names for `paths`; rename them all on success, delete them on error."""
    for path in paths:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temps = [temporary_name(p) for p in paths]
    try:
        yield temps
    except BaseException:
        for tmp in temps:
            remove_quietly(tmp)
        raise
    for tmp, path in zip(temps, paths):
        os.replace(tmp, path)


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Write `data` to `path` atomically."""
    with atomic_outputs([path]) as (tmp,), open(tmp, "wb") as f:
        f.write(data)


def save_npy_atomic(path: str, array: np.ndarray) -> None:
    """`numpy.save` to `path` atomically (no `.npy` suffix is appended)."""
    with atomic_outputs([path]) as (tmp,), open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
