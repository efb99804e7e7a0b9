"""The straggler report every --log-interval: the members' step parts gathered, scored and logged.

    log = StragglerLog(cfg, device)            # Trainer.__init__ (trainer.stragglers)
    log.new_layout(trainer)                    # Trainer.build
    log.report(trainer)                        # iteration_log.log_window, on every member
    trainer.straggler_scores                   # the last verdict (the elastic controller's)

Each member's RankTimer (rank_timing.py) gives its mean seconds per step by part; one
all-gather of those few floats over the layout's members gives every member the same table,
and with it the same verdict (megadyn/elastic/control/stragglers.py), so the leader can act on it
without another message. The hosts and devices are gathered once per layout. The logging rank
prints one line under --log-straggler (and whenever a straggler is found), appends the
figures of every rank to the metrics file (record "stragglers") and sends them to W&B
(`straggler/rank<R>/<part>_s`, `straggler/rank<R>/score`). Reporting is on with
--log-straggler or a --elastic-straggler-policy other than log.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from megadyn.elastic.control.stragglers import (
    RankFigures,
    StragglerDetector,
    StragglerScores,
    format_scores,
)
from megadyn.training.config import ConfigError, MegadynConfig
from megadyn.training.rank_timing import PARTS, RankTimer


class StragglerLog:
    """The trainer's straggler reporting (module docstring)."""

    def __init__(self, cfg: MegadynConfig, device):
        lg = cfg.logging
        self.print_line = lg.log_straggler
        self.on = lg.log_straggler or cfg.elastic.straggler_policy != "log"
        self.timer = RankTimer(device, enabled=self.on)
        self.detector = StragglerDetector(lg.straggler_threshold, lg.straggler_intervals)
        self.latest: StragglerScores | None = None
        self._names: list[tuple[str, str]] | None = None  # (host, gpu) by member, ascending

    def new_layout(self, trainer) -> None:
        """A new layout: its first step is not measured, its ranks score afresh."""
        self.timer.new_layout(trainer.chunks, dist.get_rank())
        self.detector.reset()
        self.latest, self._names = None, None

    def report(self, trainer) -> None:
        """Gather, score and (on the logging rank) log the interval that just ended; every
        member takes part (after the log line's device synchronization)."""
        if not self.on:
            return
        groups = trainer.groups
        part = self.timer.window()
        mine = torch.tensor([part[k] if part else -1.0 for k in PARTS])  # loop_group: gloo
        table = [torch.empty_like(mine) for _ in groups.grid.members]
        dist.all_gather(table, mine, group=groups.loop_group)
        if self._names is None:
            self._names = [None] * len(table)
            dist.all_gather_object(self._names, _identity(trainer.device), group=groups.loop_group)
        rows = torch.stack(table).tolist()
        if any(row[0] < 0 for row in rows):  # a member measured no step in this interval
            return
        figures = [
            RankFigures(r, host, gpu, **{f"{k}_s": v for k, v in zip(PARTS, row)})
            for r, (host, gpu), row in zip(sorted(groups.grid.members), self._names, rows)
        ]
        self.latest = self.detector.observe(trainer.iteration, figures)
        if trainer.logs:
            self._log(trainer, self.latest)

    def _log(self, trainer, scores: StragglerScores) -> None:
        if self.print_line or scores.straggler is not None:
            trainer.print(format_scores(scores, self.detector.intervals), flush=True)
        record = scores.to_dict()
        trainer.metrics_log.event("stragglers", record)
        metrics = {"straggler/max-score": max(scores.scores)}
        for r in record["ranks"]:
            for k in (*(f"{p}_s" for p in PARTS), "score"):
                metrics[f"straggler/rank{r['rank']}/{k}"] = r[k]
        trainer.wandb.log(metrics, step=scores.iteration)


def _identity(device: torch.device) -> tuple[str, str]:
    """This process's host and device, as the report names them."""
    if device.type != "cuda":
        return socket.gethostname(), "cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return socket.gethostname(), f"cuda:{index} {torch.cuda.get_device_name(index)}"


def check_straggler_flags(cfg: MegadynConfig) -> None:
    """ConfigError, naming the flag, for straggler settings that cannot run."""
    lg, policy = cfg.logging, cfg.elastic.straggler_policy
    if lg.straggler_threshold <= 1.0:
        raise ConfigError(
            f"--straggler-threshold must be above 1 (a multiple of the median rank's compute "
            f"time), got {lg.straggler_threshold}"
        )
    if lg.straggler_intervals < 1:
        raise ConfigError(f"--straggler-intervals must be >= 1, got {lg.straggler_intervals}")
    if policy != "log" and not cfg.elastic.live:
        raise ConfigError(
            f"--elastic-straggler-policy {policy} changes the layout live: it needs elastic "
            "mode (--elastic-control-port or --elastic-initial-members)"
        )
    if policy == "rebalance" and cfg.parallel.heterogeneous_pipelines is None:
        raise ConfigError(
            "--elastic-straggler-policy rebalance gives replicas different micro batch counts: "
            "it needs --heterogeneous-pipelines"
        )
