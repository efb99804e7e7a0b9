"""megadyn/elastic/recovery/retired_groups.py: the old layout's groups are destroyed by a thread, and
`join` waits for them (the controller joins before it creates groups again)."""

import threading

from megadyn.elastic.recovery.retired_groups import RetiredGroups


class _SlowGroups:
    """Groups whose destroy waits until the test lets it finish (NCCL's shutdown waits)."""

    def __init__(self):
        self.release, self.destroyed = threading.Event(), threading.Event()

    def destroy(self):
        self.release.wait(30)
        self.destroyed.set()


def test_add_returns_at_once_and_join_waits_for_the_destroy():
    retired, old = RetiredGroups(), _SlowGroups()
    retired.add(old)  # returns while destroy still waits
    assert not old.destroyed.is_set()
    assert retired.join(timeout_s=0.05) is False
    old.release.set()
    assert retired.join() is True and old.destroyed.is_set()


def test_a_second_add_first_finishes_the_first():
    retired, first, second = RetiredGroups(), _SlowGroups(), _SlowGroups()
    retired.add(first)
    threading.Timer(0.2, first.release.set).start()
    retired.add(second)  # joins the first
    assert first.destroyed.is_set()
    second.release.set()
    assert retired.join()


def test_held_groups_wait_for_start_or_join():
    retired, old = RetiredGroups(), _SlowGroups()
    old.release.set()
    retired.hold(old)  # the new layout's first step runs first
    assert not old.destroyed.wait(0.2)  # nothing destroys it before start
    retired.start()
    assert old.destroyed.wait(5) and retired.join()
