"""The survivors' decision after a failure (pure: reports in, decision out; no processes):
a standby process takes the dead member's place; without one the survivors go on under the
layout for their count; the oldest step every survivor reached is chosen, and only survivors
at that step are read from (`restrict`); where no survivor holds a piece (the distributed
optimizer's shard of the dead rank, dp 1) the decision says what is missing, and the recovery
falls back to a snapshot. A survivor's tensors are those of its step unless the step stopped
inside the optimizer's update, or ran past the last one the device had finished when the NCCL
communicators were aborted. The survivors' waits in the store end when another failure is
recorded (the agreement then starts over) or at their deadline."""

import dataclasses
import json
import threading
import time
from functools import partial
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from megadyn.core.layout import Layout
from megadyn.elastic.recovery.agreement import Holding, RecoveryError, Report, Round
from megadyn.elastic.recovery.decision import decide, decision_from_dict
from megadyn.elastic.recovery.recovery import abort
from megadyn.elastic.reshard.plan import PlanError
from megadyn.elastic.transition import distopt_of, plan_from
from megadyn.training.arguments import parse_args
from tests.tiny import tiny_args

TINY = tiny_args(num_layers=4, global_batch_size=12, train_iters=10)


def setup(layout: Layout, members, *flags: str):
    cfg = parse_args(TINY + list(flags), world_size=layout.world_size)
    distopt = partial(distopt_of, cfg)
    groups = SimpleNamespace(
        layout=layout, grid=SimpleNamespace(members=tuple(members)), backend="gloo"
    )
    return cfg, distopt, groups


def reports(layout: Layout, members, iterations: dict[int, int | None], standby=()):
    """Reports of surviving members (rank -> the step its tensors are at) and standby ranks."""
    out = {
        r: Report(
            r,
            True,
            it,
            {"state": {"iteration": it}},
            dataclasses.asdict(layout),
            list(members),
            group_count=10 + r,
        )  # fmt: skip
        for r, it in iterations.items()
    }
    out.update({r: Report(r, False, group_count=7) for r in standby})
    return out


def test_a_standby_process_takes_the_dead_members_place():
    tp2dp2 = Layout(tp=2, pp=1, dp=2)
    cfg, distopt, groups = setup(tp2dp2, range(4))
    seen = reports(tp2dp2, range(4), {0: 5, 2: 5, 3: 5}, standby=[4])
    d = decide(cfg, cfg.model, "gloo", seen, dead={1})
    # (members ascend within a pipeline stage, as torch numbers group ranks)
    assert d.layout == tp2dp2 and d.members == (0, 2, 3, 4)
    assert (d.iteration, d.sources, d.group_count) == (5, (0, 2, 3), 13)


def test_without_standby_the_survivors_take_the_layout_for_their_count():
    tp2dp2 = Layout(tp=2, pp=1, dp=2)
    cfg, distopt, groups = setup(tp2dp2, range(4))
    d = decide(cfg, cfg.model, "gloo", reports(tp2dp2, range(4), {0: 5, 1: 5, 2: 5}), {3})
    assert d.layout.world_size == 3 and sorted(d.members) == [0, 1, 2]
    assert d.sources == (0, 1, 2)


def test_the_oldest_step_every_survivor_reached_and_only_its_holders():
    # rank 2 finished step 6, rank 1 is at 5, rank 3 stopped inside an update: step 5 from
    # rank 1 alone; then rank 1 is the only source of dp replica 0's pieces and of nothing else
    dp4 = Layout(tp=1, pp=1, dp=4)
    cfg, distopt, groups = setup(dp4, range(4))
    d = decide(cfg, cfg.model, "gloo", reports(dp4, range(4), {1: 5, 2: 6, 3: None}), {0})
    assert (d.iteration, d.sources, d.newest) == (5, (1,), 6)
    assert d.training == {"state": {"iteration": 5}}


def test_a_dead_ranks_optimizer_shard_has_no_replica():
    dp2 = Layout(tp=1, pp=1, dp=2)
    cfg, distopt, groups = setup(dp2, range(2), "--use-distributed-optimizer")
    d = decide(cfg, cfg.model, "gloo", reports(dp2, range(2), {0: 4}), {1})
    assert d.sources == () and "no survivor holds a replica" in d.missing
    with pytest.raises(PlanError):
        plan_from(cfg.model, distopt, dp2, [0, 1], Layout(1, 1, 1), [0], [0])
    # without it every piece of rank 1 is a data-parallel copy of rank 0's
    cfg, distopt, groups = setup(dp2, range(2))
    plan = plan_from(cfg.model, distopt, dp2, [0, 1], Layout(1, 1, 1), [0], [0])
    assert plan.total_bytes == 0 and {t.src for t in plan.transfers} == {0}


def test_a_failure_before_a_recoverys_first_step_reads_what_the_survivor_kept():
    # dp3 lost rank 2 and the survivors went to pp2 over [0, 1] (no replica of either stage);
    # rank 1 died before step 5 ended: rank 0 still holds the whole model at step 4 under dp3
    dp3, pp2 = Layout(tp=1, pp=1, dp=3), Layout(tp=1, pp=2, dp=1)
    cfg, distopt, _ = setup(dp3, range(3))
    training = {"state": {"iteration": 4}}
    now = Report(0, True, 4, training, dataclasses.asdict(pp2), [0, 1])
    kept = Holding(4, training, dataclasses.asdict(dp3), [0, 1, 2])
    d = decide(cfg, cfg.model, "gloo", {0: dataclasses.replace(now, earlier=[kept])}, {1, 2})
    assert (d.old_layout, d.old_members) == (dp3, (0, 1, 2))
    assert (d.iteration, d.sources, d.holding, d.members) == (4, (0,), {0: 1}, (0,))
    assert decision_from_dict(json.loads(json.dumps(d.to_dict()))) == d  # the store's JSON
    d = decide(cfg, cfg.model, "gloo", {0: now}, {1})  # without it: stage 1 is lost
    assert d.sources == () and "no survivor holds a replica" in d.missing


def test_no_layout_for_the_survivors_is_an_error():
    tp2dp2 = Layout(tp=2, pp=1, dp=2)
    cfg, distopt, groups = setup(tp2dp2, range(4), "--elastic-min-members", "4")
    d = decide(cfg, cfg.model, "gloo", reports(tp2dp2, range(4), {0: 3, 1: 3, 2: 3}), {3})
    assert d.error.startswith("no layout for the survivors: 3 members is below")
    assert decision_from_dict(json.loads(json.dumps(d.to_dict()))) == d


def fake_trainer(iteration: int, clean: bool):
    return SimpleNamespace(
        built=True,
        iteration=iteration,
        model_cfg=None,
        groups=SimpleNamespace(destroy=lambda: None),
        rng_states=lambda: {},
        training_state_dict=lambda: {"state": {"iteration": iteration}},
        salvage=lambda: ({}, clean),
    )


@pytest.mark.parametrize(
    "clean, device_done, step",
    [
        (True, None, 7),  # gloo: a collective with a dead peer raised before any update
        (False, None, None),  # it stopped inside the optimizer's update
        (True, 7, 7),  # NCCL: the device had finished step 7 before the abort
        (True, 6, None),  # step 7 may have used a collective the abort cut short
    ],
)
def test_the_step_a_survivors_tensors_are_at(clean, device_done, step):
    assert abort(fake_trainer(7, clean), device_done).iteration == step


def test_waits_end_at_a_new_failure_or_their_deadline():
    # ranks 0 and 1 survive rank 2's failure; before rank 1 arrives to connect, it dies too
    dead = {2: 0.0}
    feed = SimpleNamespace(dead=lambda: dict(dead))
    rnd = Round(dist.HashStore(), set(dead))
    threading.Timer(0.2, dead.update, ({1: 1.0},)).start()
    t0 = time.monotonic()
    assert rnd.arrive(0, [0, 1], feed, timeout_s=30) is False  # start over without rank 1
    assert time.monotonic() - t0 < 5
    rnd.store.set(f"{rnd.prefix}arrived/1", b"1")
    assert rnd.arrive(0, [0, 1], SimpleNamespace(dead=lambda: {2: 0.0}), timeout_s=1) is True
    with pytest.raises(RecoveryError, match="the survivors' reports did not come within 0 s"):
        Round(dist.HashStore(), {2}).wait_reports(
            [0, 1], feed=SimpleNamespace(dead=dict), timeout_s=0.1
        )
