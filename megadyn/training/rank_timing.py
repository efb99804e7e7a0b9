"""This rank's time in the parts of each training step, for the straggler report
(straggler_log.py): waits for data, forward and backward compute, the gradient reductions,
the update.

    timer = RankTimer(device, enabled=True)       # Trainer.__init__
    timer.new_layout(chunks, rank)                # Trainer.build: the next step is not measured
    timer.begin()                                 # the step starts
    losses = forward_backward(..., timer.batches(loader), ...)   # next() time: data
    timer.mark("compute")                         # forward and backward are done
    timer.mark("grads")                           # the gradient reductions are done
    timer.mark("update")                          # loss reduction and optimizer step are done
    parts = timer.window()                        # mean seconds per step since the last call

On CPU each part is the host clock between two marks. On a GPU each mark also records a CUDA
event and a part is the device time between two events; nothing in the step synchronizes: a
step's events are read at the next step's start once the device passed them (`Event.query`),
and the rest at `window`, which runs after the log line's synchronization. The time spent
drawing micro batches is the host's, taken out of the compute part (the device idles then).

"compute" holds the forward and backward passes: on a rank that is slow it is long, on the
ranks that wait for it the wait falls into "grads" (the data-parallel reductions after the
backward). Waits inside the forward and backward (pipeline sends and receives, tensor-parallel
collectives) stay in "compute": there every rank of the pipeline or tensor-parallel group
looks as slow as the slowest, and the slowest group is what the report names.

The first step after a (re)build, an evaluation or a checkpoint save is not measured: it is slow
for everyone (allocation, warm-up, a save's writer thread), not for one rank.

MEGADYN_TEST_SLOW_RANK=rank:seconds (tests only) makes that global rank sleep `seconds` before
each forward of its first model chunk, a straggler on purpose.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import torch

PARTS = ("data", "compute", "grads", "update", "step")
"""The mean seconds per step `window` returns, by name."""
SLOW_RANK_ENV = "MEGADYN_TEST_SLOW_RANK"


class RankTimer:
    """The parts of this rank's steps (module docstring)."""

    def __init__(self, device, enabled: bool):
        self.enabled, self.cuda = enabled, torch.device(device).type == "cuda"
        self._marks: list[tuple[str, float, torch.cuda.Event | None]] = []  # this step's
        self._data_s = 0.0  # this step's draws
        self._pending: list[tuple[list, float]] = []  # steps whose events are still to read
        self._sums = dict.fromkeys(PARTS, 0.0)
        self._steps = 0
        self._skip = True  # the next step is not measured
        self._slow_hook = None

    def new_layout(self, chunks, rank: int) -> None:
        """The trainer was (re)built: its first step is not measured; the test's slow rank
        slows the new model chunks."""
        self._marks, self._pending = [], []
        self._skip = True
        if self._slow_hook is not None:
            self._slow_hook.remove()
            self._slow_hook = None
        seconds = slow_rank_seconds(rank)
        if seconds and chunks:
            self._slow_hook = chunks[0].register_forward_pre_hook(lambda *_: time.sleep(seconds))

    def skip_next(self) -> None:
        """Leave the next step out (after an evaluation or a checkpoint save)."""
        self._skip = True

    def begin(self) -> None:
        if not self.enabled:
            return
        self._read(wait=False)
        self._marks, self._data_s = [], 0.0
        self.mark("begin")

    def mark(self, part: str) -> None:
        """The end of `part` (the start of the step for "begin"); "update" ends the step."""
        if not self.enabled or (part != "begin" and not self._marks):
            return  # outside a measured step (a warm-up's gradients, say)
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self._marks.append((part, time.perf_counter(), event))
        if part == "update":
            if not self._skip:
                self._pending.append((self._marks, self._data_s))
            self._marks, self._skip = [], False
            if not self.cuda:
                self._read(wait=True)

    def batches(self, batches: Iterator) -> Iterator:
        """`batches`, the time of each `next` added to this step's data part."""
        if not self.enabled:
            return batches
        return self._timed(batches)

    def _timed(self, batches: Iterator) -> Iterator:
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self._data_s += time.perf_counter() - t0
            yield batch

    def window(self) -> dict[str, float] | None:
        """Mean seconds per measured step by part (PARTS) since the last call, None when no
        step was measured; call it after the device is synchronized."""
        self._read(wait=True)
        if not self._steps:
            return None
        out = {k: v / self._steps for k, v in self._sums.items()}
        self._sums, self._steps = dict.fromkeys(PARTS, 0.0), 0
        return out

    def _read(self, wait: bool) -> None:
        """Add the finished steps' parts to the sums (`wait`: the device is done with all)."""
        while self._pending:
            marks, data_s = self._pending[0]
            if self.cuda and not wait and not marks[-1][2].query():
                return
            self._pending.pop(0)
            parts: dict[str, float] = {}  # a part marked twice in a step adds up
            spans = _spans(marks, self.cuda)
            for (name, *_), span in zip(marks[1:], spans):
                parts[name] = parts.get(name, 0.0) + span
            parts["compute"] = max(parts.get("compute", 0.0) - data_s, 0.0)
            parts["data"], parts["step"] = data_s, sum(spans)  # step: begin to update
            for k in PARTS:
                self._sums[k] += parts.get(k, 0.0)
            self._steps += 1


def _spans(marks, cuda: bool) -> list[float]:
    """Seconds between consecutive marks: device time of their events on a GPU."""
    if cuda:
        return [a[2].elapsed_time(b[2]) / 1000 for a, b in zip(marks, marks[1:])]
    return [b[1] - a[1] for a, b in zip(marks, marks[1:])]


def slow_rank_seconds(rank: int) -> float:
    """The sleep MEGADYN_TEST_SLOW_RANK=rank:seconds asks of global rank `rank` (0: none)."""
    spec = os.environ.get(SLOW_RANK_ENV, "")
    if not spec:
        return 0.0
    try:
        slow, seconds = spec.split(":")
        return float(seconds) if int(slow) == rank else 0.0
    except ValueError as err:
        raise ValueError(f"{SLOW_RANK_ENV}={spec!r}: expected rank:seconds, e.g. 2:0.05") from err
