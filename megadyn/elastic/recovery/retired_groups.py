"""The old layout's process groups, destroyed beside the new layout's first steps.

    retired = RetiredGroups()
    retired.hold(old_groups)     # kept until the new layout's first step is done
    retired.start()              # at the next step boundary: a thread destroys them
    retired.join()               # before groups are created again, and at the job's end

Destroying an NCCL group waits in torch's ProcessGroupNCCL shutdown, which flushes and
finalizes each communicator: 1.64 s for the 1.42B model's dp 2 groups on 2 H200 (torch 2.11),
every second of which a live change used to wait for (dp 2 -> tp 2 took 2.09-2.16 s, against
0.55-0.73 s when torch finished them sooner). Nothing of the new layout uses the old groups, and
the wait holds no lock Python needs, so a thread does it while the trainer steps. It starts
after the new layout's first step, which pays NCCL's setup of the new communicators (the
destroy beside it made that step 0.3 s slower). Group creation reads and writes the same
tables of torch that destroying does: `join` comes first wherever groups are created (the next
change, a recovery) or the process ends.
"""

from __future__ import annotations

import threading


class RetiredGroups:
    """At most one set of groups being destroyed at a time, by a daemon thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._held = None

    def hold(self, groups) -> None:
        """Keep `groups` until `start` (or `join`)."""
        self.start()
        self._held = groups

    def start(self) -> None:
        """Destroy the held groups, if any, in a thread."""
        if self._held is not None:
            groups, self._held = self._held, None
            self.add(groups)

    def add(self, groups) -> None:
        """Destroy `groups` (ParallelGroups or HeteroGroups) in a thread."""
        self.join()
        self._thread = threading.Thread(
            target=groups.destroy, name="megadyn-retired-groups", daemon=True
        )
        self._thread.start()

    def join(self, timeout_s: float | None = None) -> bool:
        """Destroy the held groups and wait until the groups added last are destroyed (at most
        `timeout_s`); whether they are."""
        self.start()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        self._thread = None
        return True
