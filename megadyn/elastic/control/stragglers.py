"""Straggler detection: which rank's compute keeps the others waiting (shared/DESIGN.md section 5,
"stragglers are events too").

    detector = StragglerDetector(threshold=1.15, intervals=3)
    scores = detector.observe(iteration, figures)     # every --log-interval, on every member
    scores.straggler                                  # the rank to act on, or None

Each member measures the parts of its steps (megadyn/training/rank_timing.py) and the members
all-gather them every --log-interval (megadyn/training/straggler_log.py), so every member
holds the same figures and reaches the same verdict. A rank's score is its compute time
(forward and backward, waits for data excluded) over the median rank's: a slow rank scores
high, the ranks that wait for it do not, since their wait falls into the gradient reductions
after the backward, not into compute. A step slow for every rank (the first after a live
change, an evaluation or a checkpoint save) is not measured, and one that is slow for all
alike scores 1 everywhere. A rank above `threshold` for `intervals` consecutive intervals is
the straggler; what the job does then is --elastic-straggler-policy's (control/straggler_action.py).
This module is pure: no processes, no clocks.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RankFigures:
    """One member's mean seconds per step over a log interval."""

    rank: int
    """Global rank."""
    host: str
    gpu: str
    """The device, e.g. "cuda:3 NVIDIA H100 80GB HBM3", or "cpu"."""
    compute_s: float
    """Forward and backward (with the waits inside them), waits for data excluded."""
    data_s: float
    """Drawing micro batches."""
    grads_s: float
    """The gradient reductions after the backward: where the waits for a slow peer fall."""
    update_s: float
    """The loss reduction and the optimizer step."""
    step_s: float
    """The whole step."""


@dataclass(frozen=True)
class StragglerScores:
    """One interval's verdict."""

    iteration: int
    ranks: tuple[RankFigures, ...]
    scores: tuple[float, ...]
    """compute_s over the median member's, in the order of `ranks`."""
    streaks: tuple[int, ...]
    """Consecutive intervals each rank was above the threshold, this one included."""
    straggler: int | None
    """The rank whose streak reached the detector's interval count (the highest score first)."""

    @property
    def slowest(self) -> int:
        """Position in `ranks` of the highest score."""
        return max(range(len(self.scores)), key=self.scores.__getitem__)

    @property
    def median_step_s(self) -> float:
        return statistics.median(r.step_s for r in self.ranks)

    def to_dict(self) -> dict:
        """JSON-ready: what the leader publishes for tools/elastic_ctl.py show."""
        return {
            "iteration": self.iteration,
            "straggler": self.straggler,
            "median_step_s": round(self.median_step_s, 6),
            "ranks": [
                {**asdict(r), "score": round(s, 4), "streak": n}
                for r, s, n in zip(self.ranks, self.scores, self.streaks)
            ],
        }


class StragglerDetector:
    """Scores and streaks over consecutive intervals (module docstring)."""

    def __init__(self, threshold: float, intervals: int):
        self.threshold, self.intervals = threshold, intervals
        self._streaks: dict[int, int] = {}

    def reset(self) -> None:
        """A new layout: its ranks start again."""
        self._streaks = {}

    def observe(self, iteration: int, ranks: list[RankFigures]) -> StragglerScores:
        median = statistics.median(r.compute_s for r in ranks)
        scores = tuple(r.compute_s / median if median > 0 else 1.0 for r in ranks)
        streaks = {
            r.rank: self._streaks.get(r.rank, 0) + 1 if s > self.threshold else 0
            for r, s in zip(ranks, scores)
        }
        self._streaks = streaks
        due = [(s, r.rank) for r, s in zip(ranks, scores) if streaks[r.rank] >= self.intervals]
        return StragglerScores(
            iteration=iteration,
            ranks=tuple(ranks),
            scores=scores,
            streaks=tuple(streaks[r.rank] for r in ranks),
            straggler=max(due)[1] if due else None,
        )


def format_scores(scores: StragglerScores, intervals: int) -> str:
    """The --log-straggler line: the slowest rank, its host and GPU, its score, the median."""
    i = scores.slowest
    r = scores.ranks[i]

    def ms(part: str) -> str:  # the slowest rank's, and the median rank's
        median = statistics.median(getattr(x, part) for x in scores.ranks)
        return f"{1000 * getattr(r, part):.1f} (median {1000 * median:.1f})"

    line = (
        f" straggler: slowest rank {r.rank} ({r.host}, {r.gpu}) | score {scores.scores[i]:.2f}"
        f" x median compute | compute ms: {ms('compute_s')} | grads ms: {ms('grads_s')} |"
        f" step ms: {1000 * scores.median_step_s:.1f} | slow intervals: {scores.streaks[i]}"
        f"/{intervals}"
    )
    if scores.straggler is not None:
        line += f" | rank {scores.straggler} is a straggler"
    return line
