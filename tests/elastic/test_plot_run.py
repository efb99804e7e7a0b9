"""tools/plot_run.py draws loss and throughput with reconfigurations marked, from megadyn's log."""

import subprocess
import sys

from megadyn.elastic.controller import format_event
from megadyn.training.metrics import IterationStats, format_iteration_line


def test_plot_run_reads_log_and_writes_png(tmp_path):
    lines = []
    for it in range(1, 21):
        stats = IterationStats(
            iteration=it,
            train_iters=20,
            consumed_samples=8 * it,
            elapsed_ms=30.0,
            learning_rate=1e-3,
            global_batch_size=8,
            losses={"lm loss": 5.0 - 0.1 * it},
            tokens_per_sec=1000.0 + it,
        )
        lines.append(format_iteration_line(stats))
        if it in (5, 12):
            lines.append(
                format_event(
                    {
                        "event": "layout",
                        "epoch": 1,
                        "iteration": it,
                        "old": "tp2xpp2xdp1",
                        "new": "tp1xpp1xdp4",
                        "total_s": 0.5,
                    }
                )
            )
    log = tmp_path / "train.log"
    log.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run.png"
    done = subprocess.run(
        [sys.executable, "tools/plot_run.py", str(log), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "20 iterations, 2 reconfigurations" in done.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
