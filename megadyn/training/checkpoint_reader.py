"""Reading checkpoints: DCP's file reader with one thread per storage file of a rank.

A snapshot in host memory is written by several writer threads per rank, one file each
(checkpoint.HOST_MEMORY_WRITERS); reading those files in as many threads makes loading a
snapshot bound by memory bandwidth rather than by one thread's deserialization and copies.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed.checkpoint as dcp


class ParallelFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader, reading a rank's storage files in parallel threads (a snapshot in
    host memory is written by several writers per rank, one file each)."""

    def __init__(self, path: str, threads: int):
        super().__init__(path)
        self.threads = threads

    def read_data(self, plan, planner):
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        if len(by_file) < 2 or self.threads < 2:
            return super().read_data(plan, planner)
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        read_file = super().read_data

        def read(items):
            if device is not None:  # the current device is per thread
                torch.cuda.set_device(device)
            read_file(dataclasses.replace(plan, items=items), planner).wait()

        with ThreadPoolExecutor(min(self.threads, len(by_file))) as pool:
            list(pool.map(read, by_file.values()))
        done = torch.futures.Future()
        done.set_result(None)
        return done
