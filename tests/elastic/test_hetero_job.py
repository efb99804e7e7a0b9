"""--heterogeneous-pipelines end to end (gloo, fp32): a job that starts as a 3-stage and a
2-stage replica with the distributed optimizer trains as one process does, reads every sample
once, and its in-memory snapshot and its checkpoint resume on grids (dp 2 without, pp 2 with
the distributed optimizer); a live job with the distributed optimizer moves from a grid to
templates and between templates through tools/elastic_ctl.py with every loss equal to an
uninterrupted run's."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest
from test_live_reconfiguration import LIVE, merged_losses

from megadyn.testing import free_port, run_pretrain, spawn
from tests.tiny import tiny_args

STEP = 8  # --global-batch-size: samples per iteration
ARGS = tiny_args(LIVE, use_distributed_optimizer=None)
DISTOPT = ARGS + ["--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def reference() -> list[float]:
    """The uninterrupted 1-process run's losses, iterations 1-10."""
    return spawn(run_pretrain, world=1, args=(ARGS,))[0].history


def test_templates_train_as_one_process_and_resume_on_grids(tmp_path, reference):
    ckpt = str(tmp_path / "ckpt")
    hetero = DISTOPT + ["--heterogeneous-pipelines", "3", "2", "--exit-interval", "4"]
    hetero += ["--save", ckpt, "--save-interval", "4", "--elastic-control-port", str(free_port())]
    hetero += ["--elastic-snapshot-interval", "2", "--elastic-snapshot-dir", str(tmp_path / "snap")]
    # (its snapshot of iteration 2 completes while it trains; it resumes dp 2 below)
    results = spawn(run_pretrain, world=5, args=(hetero,), timeout_s=180)
    losses = merged_losses(results, reference[:4])  # the logging rank's, iterations 1-4
    assert sorted(losses) == [1, 2, 3, 4]
    drawn = Counter(s for r in results for s in r.samples)
    assert sorted(drawn) == list(range(4 * STEP)) and set(drawn.values()) == {1}
    snap = ["--elastic-snapshot-interval", "2", "--elastic-snapshot-dir", str(tmp_path / "snap")]
    from_snapshot = spawn(run_pretrain, world=2, args=(ARGS + snap,))[
        1
    ].history  # dp 2, from iteration 2
    for want, got in zip(reference[2:], from_snapshot, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    resumed = spawn(
        run_pretrain,
        world=2,
        args=(DISTOPT + ["--pipeline-model-parallel-size", "2", "--load", ckpt],),
    )[1].history  # the last stage logs
    for want, got in zip(reference[4:], resumed, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def elastic_ctl(port: int, *args: str) -> tuple[int, str]:
    """tools/elastic_ctl.py's main in this process (no interpreter start): exit code, output."""
    spec = importlib.util.spec_from_file_location("elastic_ctl", "tools/elastic_ctl.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = tool.main(["--port", str(port), "--timeout", "120", *args])
    return code, out.getvalue()


def operate(port: int, out: dict) -> None:
    """grid -> 3 + 2 stages at iteration 2; `show` once the replicas run; -> 2 + 1 stages."""
    out["five"] = elastic_ctl(port, "layout", "--pipelines", "3", "2", "--at-iteration", "2")
    for _ in range(200):
        out["show"] = elastic_ctl(port, "show")
        if "replicas" in out["show"][1]:
            break
        time.sleep(0.05)
    out["three"] = elastic_ctl(port, "layout", "--pipelines", "2", "1", "--at-iteration", "6")


def live_job(rank, world, argv, port):
    import pretrain_gpt

    if rank != 0:
        return pretrain_gpt.main(list(argv)), {}
    answers: dict = {}
    t = threading.Thread(target=operate, args=(port, answers), daemon=True)
    t.start()
    out = pretrain_gpt.main(list(argv))
    t.join(timeout=120)
    return out, answers


def test_live_changes_between_a_grid_and_templates(reference):
    # 4 members as dp 2 x pp 2 and a standby process -> 5 as 3 + 2 stages -> 3 as 2 + 1 stages
    port = free_port()
    argv = DISTOPT + ["--pipeline-model-parallel-size", "2", "--elastic-initial-members", "4"]
    argv += ["--heterogeneous-pipelines", "--elastic-control-port", str(port)]
    results = spawn(live_job, world=5, args=(argv, port), timeout_s=240)
    tool, results = results[0][1], [r for r, _ in results]
    assert tool["five"][0] == 0 and '"new": "tp1x[pp3+pp2]"' in tool["five"][1], tool["five"]
    assert "replica 1: 2 stages" in tool["show"][1], tool["show"]
    assert tool["three"][0] == 0 and '"new": "tp1x[pp2+pp1]"' in tool["three"][1], tool["three"]
    merged_losses(results, reference)
    drawn = Counter(s for r in results for s in r.samples)
    assert sorted(drawn) == list(range(10 * STEP)) and set(drawn.values()) == {1}


def test_a_scale_under_auto_takes_templates_where_they_use_more_members():
    from test_templates import BIG

    from megadyn.core.hetero_layout import HeteroLayout
    from megadyn.core.layout import Layout
    from megadyn.elastic.control.records import Request
    from megadyn.elastic.planning.requests import resolve_request
    from megadyn.training.config import DataConfig, MegadynConfig, ParallelConfig, TrainingConfig

    cfg = MegadynConfig(
        model=BIG,
        training=TrainingConfig(micro_batch_size=1, global_batch_size=32),
        data=DataConfig(seq_length=2048),
        parallel=ParallelConfig(heterogeneous_pipelines=()),
    )
    groups = SimpleNamespace(grid=SimpleNamespace(members=(0, 1, 2, 3)), layout=Layout(pp=4))
    groups.backend = "gloo"
    live = list(range(8))

    def scale(n: int):
        request = Request(action="scale", members=n)
        return resolve_request(request, BIG, cfg, groups, live, gpu_memory_gib=80)

    layout, members, _ = scale(7)  # no grid of this model and batch uses 7
    assert isinstance(layout, HeteroLayout) and members == list(range(7)) == list(layout.members)
    assert len({rep.num_stages for rep in layout.replicas}) > 1
    layout, members, _ = scale(6)  # a grid uses all 6
    assert isinstance(layout, Layout) and len(members) == layout.world_size == 6


def test_recovery_and_drain_keep_templates():
    # pure: the survivors' decision on 3 + 2 stages (5 ranks) after rank 4 died, and a drain
    from test_recovery_decision import TINY

    from megadyn.core.hetero_layout import HeteroLayout, layout_to_dict
    from megadyn.elastic.planning.hetero_job import pipelines_layout
    from megadyn.elastic.planning.requests import resolve_drain
    from megadyn.elastic.recovery.agreement import Report
    from megadyn.elastic.recovery.decision import decide, decision_from_dict
    from megadyn.training.arguments import parse_args

    flags = ["--heterogeneous-pipelines", "3", "2", "--elastic-initial-members", "5"]
    cfg = parse_args(TINY + flags, world_size=6)
    five = pipelines_layout(cfg.model, cfg, (3, 2), range(5), device_type="cpu")
    groups = SimpleNamespace(layout=five, grid=SimpleNamespace(members=five.members))
    groups.backend = "gloo"

    def report(r: int) -> Report:
        return Report(r, True, 5, {"state": {"iteration": 5}}, layout_to_dict(five), [*range(5)])

    seen = {r: report(r) for r in range(4)}
    d = decide(cfg, cfg.model, groups, {**seen, 5: Report(5, False)}, dead={4})
    replaced = d.layout  # the standby process 5 takes rank 4's place
    assert isinstance(replaced, HeteroLayout) and d.members == (0, 1, 2, 3, 5)
    assert replaced.replicas[1].members == (3, 5) and d.sources == (0, 1, 2, 3)
    assert decision_from_dict(json.loads(json.dumps(d.to_dict()))) == d  # the store's JSON
    d = decide(cfg, cfg.model, groups, seen, dead={4})  # no standby: 4 survivors
    assert d.layout.world_size == 4 and d.sources == (0, 1, 2, 3)
    layout, members, left = resolve_drain(2, cfg.model, cfg, groups, [*range(6)])
    assert members == [0, 1, 5, 3, 4] and left == [2]  # stage ranks ascend: here one each
    assert layout.replicas[0].members == (0, 1, 5)


def test_what_templates_do_not_run_with_is_refused_naming_both_flags():
    from test_recovery_decision import TINY

    from megadyn.training.arguments import parse_args
    from megadyn.training.config import ConfigError

    hetero = TINY + ["--heterogeneous-pipelines", "2", "1"]
    instances = ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]
    with pytest.raises(ConfigError, match="--heterogeneous-pipelines .*--num-distributed-opt"):
        parse_args(hetero + instances, world_size=3)
    with pytest.raises(ConfigError, match="--heterogeneous-pipelines .*--sequence-parallel"):
        parse_args(hetero + ["--tensor-model-parallel-size", "1", "--sequence-parallel"], 3)
    with pytest.raises(ConfigError, match="--heterogeneous-pipelines 2 1 .* needs 3 processes"):
        parse_args(hetero, world_size=4)
    assert parse_args(hetero, world_size=3).parallel.heterogeneous_pipelines == (2, 1)
