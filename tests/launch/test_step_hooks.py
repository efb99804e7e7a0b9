"""The runtime's step hooks (megadyn/launch/run.py `step_hooks`): which ones a trainer gets, in
which order, and when the snapshot schedule starts, finishes and drops its buffers. Pure
Python: a stand-in trainer, no processes."""

from types import SimpleNamespace

from megadyn.launch.run import step_hooks
from megadyn.launch.snapshot_keeper import SnapshotKeeper
from megadyn.training.config import ElasticConfig, MegadynConfig
from megadyn.training.hooks import CallableHook, StepHook, as_hooks


def test_hooks_in_order_snapshots_heartbeats_controller():
    cfg = MegadynConfig(elastic=ElasticConfig(snapshot_interval=4))
    watchdog = SimpleNamespace(step_hook=lambda trainer: None)
    controller_hook = lambda trainer: None  # noqa: E731
    hooks = step_hooks(cfg, watchdog, controller_hook)
    assert isinstance(hooks[0], SnapshotKeeper) and hooks[0].interval == 4
    assert hooks[1:] == [watchdog.step_hook, controller_hook]
    assert step_hooks(MegadynConfig(), None) == []  # no snapshots, no torchrun, no controller


def test_plain_callables_run_at_step_boundaries_only():
    calls = []
    (hook,) = as_hooks([calls.append])
    assert isinstance(hook, CallableHook) and isinstance(hook, StepHook)
    hook.quiesce("t"), hook.new_layout("t"), hook.end("t")
    hook.after_step("t")
    assert calls == ["t"]


def test_snapshot_schedule(monkeypatch):
    keeper, seen = SnapshotKeeper(3), []
    monkeypatch.setattr(keeper, "poll", lambda t: seen.append(("poll", t.state.iteration)))
    monkeypatch.setattr(keeper, "start", lambda t: seen.append(("start", t.state.iteration)))
    monkeypatch.setattr(keeper, "finish", lambda t: seen.append(("finish", t.state.iteration)))
    trainer = SimpleNamespace(state=SimpleNamespace(iteration=0), train_iters=6)
    for it in range(1, 7):
        trainer.state.iteration = it
        keeper.after_step(trainer)
    keeper.quiesce(trainer)
    keeper.end(trainer)
    polls = [("poll", it) for it in range(1, 7)]
    assert seen == polls[:3] + [("start", 3)] + polls[3:] + [("finish", 6), ("finish", 6)]
    keeper.staging = {"buffer": 1}
    keeper.new_layout(trainer)  # the old layout's host buffers go
    assert keeper.staging == {}
