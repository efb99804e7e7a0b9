"""Where the start of this process went: a few named phases, logged after a restart.

    startup.import_beside("torch.distributed.checkpoint")   # slow imports, in a thread
    startup.mark("process groups")       # the phase that ends now
    startup.timeline(since=t_fail)       # "processes started 2.1 s after it, imports 3.0 s, ..."

The first phase runs from the moment the operating system started this process (read from
/proc on Linux), so the line also shows how long the restart itself took before Python ran.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from dataclasses import dataclass, field


def process_start_time() -> float:
    """Wall-clock time at which this process started (now, where /proc is not available)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_after_boot
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


@dataclass
class Timeline:
    """When this process started and when each named phase of its start ended."""

    started: float
    phases: list[tuple[str, float]] = field(default_factory=list)

    def mark(self, phase: str) -> None:
        self.phases.append((phase, time.time()))

    def line(self, since: float | None = None) -> str:
        parts = [] if since is None else [f"process started {self.started - since:.1f} s after it"]
        previous = self.started
        for phase, at in self.phases:
            parts.append(f"{phase} {at - previous:.1f} s")
            previous = at
        return ", ".join(parts)


CLOCK = Timeline(process_start_time())
"""This process's timeline (a forked worker's is restarted from its client's start)."""


def import_beside(*modules: str) -> None:
    """Import `modules` in a background thread while this one goes on (process group, model
    build): a later import of the same module waits for that thread's import to finish. A
    module that fails to import here is imported (and fails) again where it is used."""

    def run():
        for name in modules:
            try:
                importlib.import_module(name)
            except ImportError:
                pass

    # not a daemon: the interpreter's exit waits for it. A daemon thread still importing when
    # a short job ends is stopped inside C++ code at finalization, which aborts the process
    # ("terminate called without an active exception") after a successful run
    threading.Thread(target=run, name="megadyn-imports").start()


def restarted_from(started: float) -> None:
    """This process was forked for a worker whose own process started at `started` (wall
    clock; megadyn/launch/fork_server.py): its phases count from there."""
    CLOCK.started = started
    CLOCK.phases.clear()
    CLOCK.mark("hand-over to the fork server")


def mark(phase: str) -> None:
    """The phase named `phase` of this process's start ends now."""
    CLOCK.mark(phase)


def timeline(since: float | None = None) -> str:
    """The phases so far, each with its duration; with `since` (wall clock, e.g. the last
    heartbeat of a failed rank) first how long after it this process started."""
    return CLOCK.line(since)
