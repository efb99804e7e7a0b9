"""The metrics file: where it goes, appending across restarts and a line cut short by a kill,
and the tools that read it (tools/compare_losses.py, tools/plot_run.py)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from megadyn.training.config import CheckpointConfig, LoggingConfig, MegadynConfig
from megadyn.training.metrics import IterationStats
from megadyn.training.metrics_log import MetricsLog, iterations, read_metrics

REPO = Path(__file__).resolve().parents[2]


def stats(it: int, loss: float, **kw) -> IterationStats:
    return IterationStats(
        iteration=it,
        train_iters=20,
        consumed_samples=4 * it,
        elapsed_ms=12.5,
        learning_rate=1e-3,
        global_batch_size=4,
        losses={"lm loss": loss},
        **kw,
    )


def test_the_file_is_metrics_file_else_under_save_else_none(tmp_path):
    save = CheckpointConfig(save=str(tmp_path / "ckpt"), save_interval=1)
    chosen = LoggingConfig(metrics_file=str(tmp_path / "m.jsonl"))
    assert MetricsLog.from_config(MegadynConfig(checkpoint=save)).path == os.path.join(
        save.save, "metrics.jsonl"
    )
    assert MetricsLog.from_config(MegadynConfig(checkpoint=save, logging=chosen)).path == (
        chosen.metrics_file
    )
    nothing = MetricsLog.from_config(MegadynConfig())
    assert nothing.path is None
    nothing.iteration(stats(1, 2.0))  # writes nowhere


def test_records_are_appended_and_a_cut_line_is_passed_over(tmp_path):
    path = tmp_path / "new_dir" / "metrics.jsonl"
    log = MetricsLog(str(path))
    log.iteration(stats(1, 3.25, grad_norm=float("nan"), tokens_per_sec=800.0))
    log.iteration(stats(2, 3.0))
    log.event("reconfiguration", {"event": "layout", "iteration": 2, "old": "a", "new": "b"})
    with open(path, "a") as f:
        f.write('{"record": "iteration", "time": "2026-11-26T17:30:01", "iteration": 3, "lo')
    later = MetricsLog(str(path))  # a restarted process, resumed from iteration 1
    later.iteration(stats(2, 2.5))
    later.iteration(stats(3, 2.0))
    lines = path.read_text().splitlines()
    assert len(lines) == 6 and lines[3].endswith('"lo')  # the cut line stays on its own
    records = read_metrics(path)
    assert [(r["record"], r["iteration"]) for r in records] == [
        ("iteration", 1),
        ("iteration", 2),
        ("reconfiguration", 2),
        ("iteration", 2),
        ("iteration", 3),
    ]
    first = records[0]
    assert first["losses"] == {"lm loss": 3.25} and math.isnan(first["grad_norm"])
    assert first["consumed_samples"] == 4 and first["tokens_per_sec"] == 800.0
    assert first["peak_mem_gib"] is None and first["elapsed_ms"] == 12.5
    assert records[2]["event"] == "layout" and records[2]["new"] == "b"
    by_iteration = iterations(records)
    assert [(i, r["losses"]["lm loss"]) for i, r in by_iteration.items()] == [
        (1, 3.25),
        (2, 2.5),
        (3, 2.0),
    ]
    json.loads(lines[-1])  # each complete line is one JSON object


def run_tool(*args: str) -> subprocess.CompletedProcess:
    """A tool of tools/ run as a user runs it, on this tree's megadyn."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )


def test_compare_losses_reads_metrics_files(tmp_path):
    ref, other = MetricsLog(str(tmp_path / "ref.jsonl")), MetricsLog(str(tmp_path / "o.jsonl"))
    for it, loss in enumerate([4.0, 3.0, 2.0], start=1):
        ref.iteration(stats(it, loss))
        other.iteration(stats(it, loss * (1.01 if it == 2 else 1.0)))
    done = run_tool("tools/compare_losses.py", ref.path, other.path)
    rows = done.stdout.splitlines()
    assert done.returncode == 0 and rows[1].split()[1:] == ["3", "4.0000", "2.0000", "0.00e+00"]
    assert rows[2].split()[1:] == ["3", "4.0000", "2.0000", "1.00e-02"]

    help_text = run_tool("tools/compare_losses.py", "--help")
    assert help_text.returncode == 0 and help_text.stdout.startswith(
        "usage: tools/compare_losses.py [-h] reference [run ...]"
    ), help_text.stdout + help_text.stderr
    missing = run_tool("tools/compare_losses.py", ref.path, str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 2 and missing.stderr.splitlines()[-1] == (
        f"tools/compare_losses.py: error: {tmp_path / 'nope.jsonl'}: no such metrics file"
    ), missing.stderr


def test_plot_run_reads_metrics_and_writes_png(tmp_path):
    """Loss and throughput with the reconfigurations marked."""
    metrics = MetricsLog(str(tmp_path / "metrics.jsonl"))
    for it in range(1, 21):
        metrics.iteration(stats(it, 5.0 - 0.1 * it, tokens_per_sec=1000.0 + it))
        if it in (5, 12):
            event = {"event": "layout", "epoch": 1, "iteration": it, "total_s": 0.5}
            metrics.event("reconfiguration", {**event, "old": "tp2xpp2xdp1", "new": "tp1xpp1xdp4"})
        if it == 10:  # killed mid-line, resumed from iteration 8: 9 and 10 are logged again
            with open(metrics.path, "a") as f:
                f.write('{"record": "iteration", "time": "2026-11-26T17:30:01", "iter')
            metrics.iteration(stats(9, 4.1, tokens_per_sec=1009.0))
            metrics.iteration(stats(10, 4.0, tokens_per_sec=1010.0))
    out = tmp_path / "run.png"
    done = run_tool("tools/plot_run.py", metrics.path, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "20 iterations, 2 reconfigurations" in done.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
