"""An output directory that appears whole or not at all.

    with atomic_directory("out/ckpt", "--save-dir") as tmp:
        write(tmp)                 # an error here removes tmp: no half-written out/ckpt
    # out/ckpt now holds what was written to tmp (renamed into place)

The temporary directory is a hidden sibling of the target (same file system, so the final
rename is atomic). An existing target must be an empty directory: converting into a directory
that holds something else would mix outputs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from megadyn.convert.errors import ConversionError


def check_output_dir(path: str, flag: str) -> None:
    """Raise unless `path` is free (absent or an empty directory)."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConversionError(f"{flag} {path}: exists and is not empty; name a new directory")


@contextlib.contextmanager
def atomic_directory(path: str, flag: str) -> Iterator[str]:
    path = os.path.abspath(path)
    check_output_dir(path, flag)
    parent = os.path.dirname(path)
    created = parent
    while not os.path.exists(os.path.dirname(created)):
        created = os.path.dirname(created)  # the outermost parent this call creates
    created = None if os.path.exists(parent) else created
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.partial-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        yield tmp
        if os.path.isdir(path):
            os.rmdir(path)  # empty (checked above)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
