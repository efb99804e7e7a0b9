"""Reading checkpoints: DCP's file reader with a rank's items spread over several threads.

Each thread deserializes its items and copies them to the device; in parallel, loading a
snapshot from host memory is bound by memory bandwidth rather than by one thread's work.

torch.distributed.checkpoint is imported at first use (`dcp()`): its import takes seconds, which
a restarted process spends beside its start instead (pretrain_gpt.py, startup.import_beside).
"""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor

import torch


def dcp():
    """torch.distributed.checkpoint, imported at first use."""
    import torch.distributed.checkpoint

    return torch.distributed.checkpoint


def parallel_reader(path: str, threads: int):
    """A DCP storage reader of `path` reading a rank's files in up to `threads` threads."""
    return _reader_class()(path, threads)


@functools.cache
def _reader_class():
    class ParallelFileSystemReader(dcp().FileSystemReader):
        """DCP's file reader, reading a rank's items in parallel threads."""

        def __init__(self, path: str, threads: int):
            super().__init__(path)
            self.threads = threads

        def _length(self, item) -> int:
            return self.storage_data[item.storage_index].length

        def read_data(self, plan, planner):
            # the items in `threads` groups of about equal bytes, each read by its own thread
            loads = [[0, []] for _ in range(min(self.threads, len(plan.items)))]
            for item in sorted(plan.items, key=self._length, reverse=True):
                least = min(loads, key=lambda load: load[0])
                least[0] += self._length(item)
                least[1].append(item)
            if len(loads) < 2:
                return super().read_data(plan, planner)
            device = torch.cuda.current_device() if torch.cuda.is_available() else None
            read_file = super().read_data

            def read(items):
                if device is None:
                    return read_file(dataclasses.replace(plan, items=items), planner).wait()
                torch.cuda.set_device(device)  # the current device is per thread
                stream = torch.cuda.Stream(device)  # the threads' copies to the device overlap
                # the targets were allocated on the default stream: its work so far goes first
                stream.wait_stream(torch.cuda.default_stream(device))
                with torch.cuda.stream(stream):
                    read_file(dataclasses.replace(plan, items=items), planner).wait()
                stream.synchronize()

            with ThreadPoolExecutor(len(loads)) as pool:
                list(pool.map(read, [items for _, items in loads]))
            done = torch.futures.Future()
            done.set_result(None)
            return done

    return ParallelFileSystemReader
