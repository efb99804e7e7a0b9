"""Reading checkpoints: DCP's file reader with a rank's items spread over several threads.

Each thread deserializes its items and copies them to the device; in parallel, loading a
snapshot from host memory is bound by memory bandwidth rather than by one thread's work. A file
whose bytes do not decode is a `CheckpointError` naming the file (torch's own message would
advise loading it with `weights_only=False`). Given the checkpoint's recorded checksums
(checksums.py), each item's bytes are checked as they are read; `checksum_s` is the time that
took, summed over the threads.

torch.distributed.checkpoint is imported at first use (`dcp()`): its import takes seconds, which
a restarted process spends beside its start instead (pretrain_gpt.py, startup.import_beside).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from megadyn.training.config import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded; the message names the directory or file, what is
    wrong with it and what to do."""


def dcp():
    """torch.distributed.checkpoint, imported at first use."""
    import torch.distributed.checkpoint

    return torch.distributed.checkpoint


def parallel_reader(path: str, threads: int, expected=None):
    """A DCP storage reader of `path` reading a rank's files in up to `threads` threads and
    checking each item against `expected` (a checksums.Expected; None: not checked)."""
    return _reader_class()(path, threads, expected)


def why_unreadable(err: BaseException) -> str:
    """What a failed decode says, in one line and never torch's advice to load with
    `weights_only=False` (which a damaged file does not need)."""
    if isinstance(err, OSError):
        return err.strerror or str(err)
    first = (str(err).splitlines() or [""])[0]
    said = type(err).__name__ if "weights" in first.lower() else f"{type(err).__name__}: {first}"
    return f"the file is damaged, its bytes do not decode ({said.rstrip(': ')})"


@functools.cache
def _reader_class():
    class ParallelFileSystemReader(dcp().FileSystemReader):
        """DCP's file reader, reading a rank's items in parallel threads."""

        def __init__(self, path: str, threads: int, expected=None):
            super().__init__(path)
            self.threads, self.expected = threads, expected
            self._checksum_s, self._lock = 0.0, threading.Lock()

        @property
        def checksum_s(self) -> float:
            """Seconds spent checking checksums, summed over the reader threads."""
            return self._checksum_s

        def _slice_file(self, file, sinfo):
            # DCP's FileSystemReader reads each stored item through this (a private method;
            # tests/training/test_checkpoint_faults.py fails if a torch release stops calling it)
            # The checksum reads the item's bytes with os.pread, which like zlib's CRC-32 runs
            # without the GIL; torch.load then reads them again from the file (page cache). A
            # copy into Python bytes handed to torch.load instead held the GIL for each item's
            # whole copy: a snapshot read beside the warm-up step starved its kernel launches
            # (the warm-up's forward and backward took 15.6 s instead of about 0.6 s).
            if self.expected is not None:
                start = time.perf_counter()
                self.expected.check_range(str(self.path), sinfo.relative_path, sinfo.offset, file)
                with self._lock:
                    self._checksum_s += time.perf_counter() - start
            return super()._slice_file(file, sinfo)

        def _length(self, item) -> int:
            return self.storage_data[item.storage_index].length

        def _read_files(self, plan, planner, items) -> None:
            """Read `items` file by file; a file that fails is named in a CheckpointError."""
            by_file: dict[str, list] = {}
            for item in items:
                name = self.storage_data[item.storage_index].relative_path
                by_file.setdefault(name, []).append(item)
            for name, file_items in by_file.items():
                try:
                    read = super().read_data(dataclasses.replace(plan, items=file_items), planner)
                    read.wait()
                except CheckpointError:
                    raise  # the checksum names the file and the tensor
                except Exception as e:  # noqa: BLE001 - any decode error: the file is damaged
                    path = os.path.join(str(self.path), name)
                    raise CheckpointError(f"{path} is unreadable: {why_unreadable(e)}") from None

        def read_data(self, plan, planner):
            # the items in `threads` groups of about equal bytes, each read by its own thread
            loads = [[0, []] for _ in range(min(self.threads, len(plan.items)))]
            for item in sorted(plan.items, key=self._length, reverse=True):
                least = min(loads, key=lambda load: load[0])
                least[0] += self._length(item)
                least[1].append(item)
            device = torch.cuda.current_device() if torch.cuda.is_available() else None

            def read(items):
                if device is None:
                    return self._read_files(plan, planner, items)
                torch.cuda.set_device(device)  # the current device is per thread
                stream = torch.cuda.Stream(device)  # the threads' copies to the device overlap
                # the targets were allocated on the default stream: its work so far goes first
                stream.wait_stream(torch.cuda.default_stream(device))
                with torch.cuda.stream(stream):
                    self._read_files(plan, planner, items)
                stream.synchronize()

            if len(loads) < 2:
                self._read_files(plan, planner, plan.items)
            else:
                with ThreadPoolExecutor(len(loads)) as pool:
                    list(pool.map(read, [items for _, items in loads]))
            done = torch.futures.Future()
            done.set_result(None)
            return done

    return ParallelFileSystemReader
