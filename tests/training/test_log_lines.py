"""What pretrain_gpt.py prints, read as a user reads it under torchrun: the start line says how
many processes wait as standby, and a CPU run's iteration lines carry no MFU (there is no peak
to measure it against); the metrics file and tools/plot_run.py do without it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megadyn.testing import free_port
from tests.tiny import RUN, tiny_args

REPO = Path(__file__).resolve().parents[2]
TINY = tiny_args(
    RUN, num_layers=1, hidden_size=16, num_attention_heads=2, global_batch_size=2, train_iters=2
)


@pytest.fixture(scope="module")
def standby_run(tmp_path_factory) -> tuple[int, str, Path]:
    """torchrun of 2 processes, 1 in the layout and 1 standby: (exit status, output, metrics)."""
    metrics = tmp_path_factory.mktemp("run") / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(free_port()), "pretrain_gpt.py", *TINY]
    cmd += ["--elastic-initial-members", "1", "--elastic-control-port", str(free_port())]
    cmd += ["--metrics-file", str(metrics)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    return done.returncode, done.stdout + done.stderr, metrics


def test_the_start_line_counts_the_standby_processes(standby_run):
    code, out, _ = standby_run
    assert code == 0, out[-4000:]
    starts = [line for line in out.splitlines() if " megadyn: 2 processes" in line]
    assert starts == [
        " megadyn: 2 processes (1 in the layout, 1 standby), layout tp=1 pp=1 dp=1 vpp=1 "
        "sequence_parallel=False, device cpu"
    ], out[-4000:]


def test_a_cpu_run_prints_no_mfu(standby_run, tmp_path):
    code, out, metrics = standby_run
    lines = [line for line in out.splitlines() if re.search(r" iteration +\d+/", line)]
    assert code == 0 and len(lines) == 2, out[-4000:]
    assert all("tokens/s: " in line and "MFU" not in line for line in lines), lines
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["mfu"] for r in records if r["record"] == "iteration"] == [None, None]
    png = tmp_path / "run.png"
    plot = [sys.executable, "tools/plot_run.py", str(metrics), "--out", str(png)]
    done = subprocess.run(plot, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and png.stat().st_size > 0, done.stderr
