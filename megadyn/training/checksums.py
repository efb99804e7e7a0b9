"""Checksums of a checkpoint's stored tensors: recorded at save, verified as a load reads them.

    dcp.save(..., storage_writer=keep_write_results(writer))
    sums, seconds = record(path, writer.results)   # this rank's stored items
    meta[CHECKSUMS] = manifest(sums_of_every_rank)  # megadyn.json, written when the save finishes
    expected = Expected.of(meta)                    # None: saved before checksums were recorded
    expected.check_range(path, name, offset, file)  # a load's item, else a CheckpointError

Every stored item (one tensor's piece, or a scalar's) occupies a byte range of a `.distcp`
file that DCP's `.metadata` names (file, offset, length). Each rank checksums the items it
wrote (its storage writer's results), reading them back after `dcp.save` returned; the save's leader writes all
ranks' sums into megadyn.json before the directory is renamed into place, so a checkpoint has
its manifest exactly when it is complete. A load checks each item's bytes against the manifest
as the reader reads them (checkpoint_reader.py: the checksum reads the item from the page cache
and torch.load reads it again, neither holding the GIL); an item whose bytes changed is a
CheckpointError naming the file, the tensor and both checksums.

The checksum is zlib's CRC-32: in the standard library (any machine that wrote a checkpoint can
verify it), 3-7 GB/s on one core (16 GB/s over 8 threads on the GPU machine), and zlib releases the GIL, so the reader threads check in
parallel. It detects any change of up to 32 consecutive bits and misses a random change with
probability 2**-32. (Measured on a 100 MB buffer: crc32 14 ms, blake2b 70 ms, sha1 45 ms;
xxhash's xxh3_64 3 ms, but xxhash is not a dependency of megadyn.)
"""

from __future__ import annotations

import dataclasses
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

from megadyn.training.checkpoint_reader import CheckpointError

CHECKSUMS = "checksums"
"""The key of megadyn.json that holds the manifest."""
ALGORITHM = "crc32"


def unverified(path: str) -> str:
    """The line for a checkpoint without a manifest (loaded, its bytes not checked)."""
    return f"{path}: not verified (saved before megadyn recorded checksums)"


THREADS = 8
"""Threads per rank that read back and checksum its items after a save."""
_BLOCK = 64 << 20  # bytes read at once


def crc(data, value: int = 0) -> int:
    """The CRC-32 of `data` (bytes-like), continued from `value`."""
    return zlib.crc32(data, value)


def _crc_of_range(fd: int, offset: int, length: int) -> int:
    value, done = 0, 0
    while done < length:
        block = os.pread(fd, min(_BLOCK, length - done), offset + done)
        if not block:  # the file ends early: the checksum cannot match
            break
        value, done = crc(block, value), done + len(block)
    return value


def _crcs(path: str, ranges: list[tuple[str, int, int]]) -> list[int]:
    """The checksum of each (file, offset, length) byte range of the files in `path`, read in
    `THREADS` threads."""
    fds = {name: os.open(os.path.join(path, name), os.O_RDONLY) for name in {r[0] for r in ranges}}
    try:
        with ThreadPoolExecutor(THREADS) as pool:
            return list(pool.map(lambda r: _crc_of_range(fds[r[0]], r[1], r[2]), ranges))
    finally:
        for fd in fds.values():
            os.close(fd)


def keep_write_results(writer):
    """`writer` (a DCP storage writer) keeps the results of its `write_data` on `.results`:
    where this rank stored each item. (The Metadata that dcp.save returns lists them only on
    the save's coordinator in some torch versions: torch 2.11 returns none on any rank.)"""
    write = writer.write_data

    def write_data(plan, planner):
        future = write(plan, planner)
        writer.results = future.wait()
        return future

    writer.results = []
    writer.write_data = write_data
    return writer


def record(path: str, results) -> tuple[dict[str, list], float]:
    """{file: [[offset, length, crc, key], ...]} of the items this rank wrote into the DCP
    checkpoint `path` (`results`: its storage writer's WriteResults, `keep_write_results`),
    and the seconds spent."""
    start = time.perf_counter()
    mine = sorted(
        (r.storage_data.relative_path, r.storage_data.offset, r.storage_data.length, r.index.fqn)
        for r in results
    )
    files: dict[str, list] = {}
    for (name, offset, length, key), value in zip(mine, _crcs(path, [m[:3] for m in mine])):
        files.setdefault(name, []).append([offset, length, value, key])
    return files, time.perf_counter() - start


def manifest(per_rank: list[dict[str, list]]) -> dict:
    """The megadyn.json entry for the items of every rank (`record`'s dicts)."""
    files = {name: items for sums in per_rank for name, items in sums.items()}
    return {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}


@dataclasses.dataclass(frozen=True)
class Expected:
    """The recorded checksum of each stored item: {(file, offset): (length, crc, key)}."""

    items: dict[tuple[str, int], tuple[int, int, str]]

    @classmethod
    def of(cls, meta: dict) -> Expected | None:
        """The manifest of a checkpoint's megadyn.json; None when it has none (saved before
        checksums were recorded)."""
        entry = meta.get(CHECKSUMS)
        if not entry:
            return None
        if entry.get("algorithm") != ALGORITHM:
            raise ValueError(f"checksums by {entry.get('algorithm')!r}, not {ALGORITHM}")
        return cls(
            {
                (name, int(offset)): (int(length), int(value), str(key))
                for name, items in entry["files"].items()
                for offset, length, value, key in items
            }
        )

    def verify(self, path: str) -> None:
        """Read every recorded item of the checkpoint directory `path` and `check` it (for a
        tool that copies the files rather than loading them through the reader)."""
        ranges = sorted((name, offset, want[0]) for (name, offset), want in self.items.items())
        for (name, offset, _), got in zip(ranges, _crcs(path, ranges)):
            self.check(path, name, offset, got=got)

    def check_range(self, path: str, name: str, offset: int, file) -> None:
        """`check` the item of `path`/`name` at `offset`, reading its recorded byte range from
        the open `file` (its position does not move)."""
        want = self.items.get((name, offset))
        if want is not None:
            self.check(path, name, offset, got=_crc_of_range(file.fileno(), offset, want[0]))

    def check(self, path: str, name: str, offset: int, got: int) -> None:
        """Raise a CheckpointError unless `got`, the checksum of the bytes of `path`/`name` at
        `offset`, is the one recorded for that item (an item not in the manifest is not
        checked)."""
        want = self.items.get((name, offset))
        if want is None:
            return
        length, value, key = want
        if got != value:
            raise CheckpointError(
                f"{os.path.join(path, name)} fails its checksum in tensor {key} (bytes "
                f"{offset}..{offset + length}: {ALGORITHM} {got & 0xFFFFFFFF:08x}, megadyn.json recorded "
                f"{value:08x}); its bytes changed after the save"
            )
