"""pretrain_gpt.py for a test: one worker SIGKILLs itself while its snapshot files are half
written (test only; megadyn has no fault injection).

    torchrun ... tests/elastic/kill_mid_snapshot.py <pretrain_gpt.py flags>

Environment: KILL_RANK (the worker that dies), KILL_ITERATION (the snapshot it dies in). Only
the first attempt (TORCHELASTIC_RESTART_COUNT 0) dies; the restarted workers run normally.
"""

import os
import signal
import sys
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pretrain_gpt  # noqa: E402


def install() -> None:
    rank, iteration = os.environ["KILL_RANK"], int(os.environ["KILL_ITERATION"])
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or os.environ["RANK"] != rank:
        return
    real_write = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        future = real_write(self, plan, planner)
        if f".iter_{iteration:07d}.partial" in str(self.path):
            written = future.wait()
            name = written[0].storage_data.relative_path
            path = os.path.join(self.path, name)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)  # half of one file is on disk
            print(f" test: rank {rank} killed while writing {path}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    FileSystemWriter.write_data = write_data


if __name__ == "__main__":
    install()
    pretrain_gpt.main()
