"""Damage for tests of checkpoint verification: bytes overwritten inside a stored tensor, the
file keeping its size (as a disk or a copy gone wrong leaves it).

    name, key = flip_bytes("ckpt/iter_0000006", "optim.")   # the largest optim.* item
"""

from __future__ import annotations

import os

import torch.distributed.checkpoint as dcp


def flip_bytes(directory: str, prefix: str = "", n: int = 16, rank: int = 0) -> tuple[str, str]:
    """Invert `n` bytes in the middle of the largest item whose key starts with `prefix` in
    group rank `rank`'s first `.distcp` file of the DCP checkpoint `directory`; returns (file
    name, key)."""
    storage = dcp.FileSystemReader(directory).read_metadata().storage_data
    index, info = max(
        (
            (index, info)
            for index, info in storage.items()
            if index.fqn.startswith(prefix) and info.relative_path == f"__{rank}_0.distcp"
        ),
        key=lambda found: found[1].length,
    )
    with open(os.path.join(directory, info.relative_path), "r+b") as f:
        f.seek(info.offset + info.length // 2)
        data = f.read(n)
        f.seek(info.offset + info.length // 2)
        f.write(bytes(255 - b for b in data))
    return info.relative_path, index.fqn
