"""The run's metrics as JSON lines: one record per log interval and per elastic event.

    log = MetricsLog.from_config(cfg)          # --metrics-file, default <--save>/metrics.jsonl
    log.iteration(stats)                       # iteration_log.log_window, on the logging rank
    log.event("reconfiguration", event)        # Trainer.log_event (the elastic controller)
    records = read_metrics(path)               # tools/plot_run.py, tools/compare_losses.py
    by_iteration = iterations(records)         # {iteration: record}, the last of each

A record holds what the iteration line prints and W&B receives (the fields of `IterationStats`,
full precision), or the fields of an event, after its kind and the wall-clock time:

    {"record": "iteration", "time": "2026-11-26T17:30:01", "iteration": 10, "train_iters": 100,
     "consumed_samples": 160, "elapsed_ms": 812.4, "learning_rate": 0.0003,
     "global_batch_size": 16, "losses": {"lm loss": 6.93}, "loss_scale": 1.0, "grad_norm": 2.1,
     "skipped_iterations": 0, "nan_iterations": 0, "tflops_per_gpu": 98.1,
     "tokens_per_sec": 40331.0, "mfu": 0.099, "peak_mem_gib": 11.2}
    {"record": "reconfiguration", "time": "...", "event": "layout", "epoch": 1, "iteration": 12,
     "old": "tp2xpp2xdp1", "new": "tp1xpp1xdp4", "total_s": 0.5, ...}

Non-finite numbers are written as NaN / Infinity, as Python's json does. The file is only ever
appended to, one line per write, flushed: a restarted or resumed run's lines follow the earlier
ones (`iterations` keeps the last record of an iteration logged twice), and whichever process
logs after a reconfiguration appends to the same file. A line cut short by a kill is skipped by
`read_metrics`, and the next write starts a new line after it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from megadyn.training.config import MegadynConfig
from megadyn.training.metrics import IterationStats


@dataclass(frozen=True)
class MetricsLog:
    """Appends records to `path` (nothing when it is None)."""

    path: str | None

    @classmethod
    def from_config(cls, cfg: MegadynConfig) -> MetricsLog:
        """--metrics-file, else <--save>/metrics.jsonl, else no file."""
        path = cfg.logging.metrics_file
        if not path and cfg.checkpoint.save:
            path = os.path.join(cfg.checkpoint.save, "metrics.jsonl")
        return cls(path or None)

    def iteration(self, stats: IterationStats) -> None:
        self.write("iteration", dataclasses.asdict(stats))

    def event(self, name: str, event: dict[str, Any]) -> None:
        self.write(name, event)

    def write(self, kind: str, values: dict[str, Any]) -> None:
        """One line: {"record": kind, "time": now, **values}."""
        if self.path is None:
            return
        now = datetime.now().isoformat(timespec="seconds")
        line = json.dumps({"record": kind, "time": now, **values}, default=float) + "\n"
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a+b") as f:  # writes go to the end, whatever the position
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # the last line was cut short: leave it on its own
                    line = "\n" + line
            f.write(line.encode())
            f.flush()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The complete records of a metrics file, in the order written."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            if isinstance(record, dict) and "record" in record:
                records.append(record)
    return records


def iterations(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The iteration records by iteration, ascending; where a resumed run logged an iteration
    again, its last record."""
    last = {r["iteration"]: r for r in records if r["record"] == "iteration"}
    return dict(sorted(last.items()))
