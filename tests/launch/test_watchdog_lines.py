"""Watchdog lines of several ranks printed at once stay whole lines in the job's output: each
rank writes its line and newline in one call (megadyn/launch/console.py), where print()
wrote them apart and torchrun's log showed two lines run together."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

LINES = 5000
RANK = """
import sys
import time
import torch.distributed as dist
from megadyn.launch.watchdog import Watchdog

rank, start = int(sys.argv[1]), float(sys.argv[2])
watchdog = Watchdog(dist.HashStore(), rank=rank, world=2, timeout=5.0, restart=0)
time.sleep(max(0.0, start - time.time()))  # both ranks print at the same moment
for i in range({lines}):
    watchdog.print(f" watchdog: rank {{rank}}: rank {{1 - rank}} sent no heartbeat ({{i}})", flush=True)
"""


def test_lines_printed_at_once_by_two_ranks_stay_whole():
    """Two ranks' watchdogs print into one pipe unbuffered, as workers do under torchrun."""
    read, write = os.pipe()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    code, start = RANK.format(lines=LINES), str(time.time() + 4)  # after both imports
    ranks = [
        subprocess.Popen([sys.executable, "-c", code, str(r), start], stdout=write, env=env)
        for r in (0, 1)
    ]
    os.close(write)
    with os.fdopen(read) as pipe:
        out = pipe.read()
    assert [p.wait(timeout=60) for p in ranks] == [0, 0]
    lines = out.splitlines()
    whole = r" watchdog: rank ([01]): rank [01] sent no heartbeat \(\d+\)"
    broken = [line for line in lines if not re.fullmatch(whole, line)]
    assert not broken and len(lines) == 2 * LINES, broken[:5]
