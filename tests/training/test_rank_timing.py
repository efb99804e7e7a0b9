"""RankTimer (megadyn/training/rank_timing.py) on CPU: the parts of a step from host clocks, the
data draws taken out of compute, the first step after a build and the step after an
evaluation or a save left out, and the test hook that slows one rank's forward."""

import time

import pytest
import torch

from megadyn.training.rank_timing import SLOW_RANK_ENV, RankTimer, slow_rank_seconds


def step(timer: RankTimer, compute_s: float, data_s: float = 0.0, grads_s: float = 0.0):
    def draws():
        while True:
            time.sleep(data_s)
            yield {}

    timer.begin()
    batches = timer.batches(draws())
    next(batches)
    time.sleep(compute_s)
    timer.mark("compute")
    time.sleep(grads_s)
    timer.mark("grads")
    timer.mark("update")


def test_parts_of_measured_steps():
    timer = RankTimer("cpu", enabled=True)
    step(timer, 0.2)  # the first step after a build: not measured
    assert timer.window() is None
    step(timer, 0.02, data_s=0.03, grads_s=0.01)
    step(timer, 0.02, data_s=0.03, grads_s=0.01)
    parts = timer.window()
    assert parts["data"] == pytest.approx(0.03, abs=0.01)
    assert parts["compute"] == pytest.approx(0.02, abs=0.01)  # the draws taken out
    assert parts["grads"] == pytest.approx(0.01, abs=0.01)
    assert parts["step"] == pytest.approx(0.06, abs=0.02)
    assert timer.window() is None  # a window holds the steps since the last one
    timer.skip_next()  # an evaluation or a save ran
    step(timer, 0.2)
    step(timer, 0.01)
    assert timer.window()["compute"] < 0.1


def test_a_disabled_timer_measures_nothing():
    timer = RankTimer("cpu", enabled=False)
    loader = iter([{}])
    assert timer.batches(loader) is loader
    step(timer, 0.0)
    step(timer, 0.0)
    assert timer.window() is None


def test_the_slow_rank_hook_sleeps_before_its_forward(monkeypatch):
    monkeypatch.setenv(SLOW_RANK_ENV, "1:0.05")
    assert slow_rank_seconds(1) == 0.05 and slow_rank_seconds(0) == 0.0
    chunk = torch.nn.Linear(2, 2)
    timer = RankTimer("cpu", enabled=True)
    timer.new_layout([chunk], rank=1)
    t0 = time.perf_counter()
    chunk(torch.zeros(1, 2))
    assert time.perf_counter() - t0 >= 0.05
    timer.new_layout([chunk], rank=0)  # another layout: the hook goes
    t0 = time.perf_counter()
    chunk(torch.zeros(1, 2))
    assert time.perf_counter() - t0 < 0.05
    monkeypatch.setenv(SLOW_RANK_ENV, "one")
    with pytest.raises(ValueError, match=SLOW_RANK_ENV):
        slow_rank_seconds(1)
