"""--heterogeneous-pipelines end to end (gloo, fp32): a job that starts as a 3-stage and a
2-stage replica trains as one process does, reads every sample once and saves a checkpoint that
resumes on a grid; a live job moves from a grid to templates and back through
tools/elastic_ctl.py with every loss equal to an uninterrupted run's."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter

from test_live_reconfiguration import ARGS as GRID_ARGS
from test_live_reconfiguration import merged_losses

from megadyn.testing import free_port, run_pretrain, spawn

STEP = 8  # --global-batch-size: samples per iteration
ARGS = [a for a in GRID_ARGS if a != "--use-distributed-optimizer"]  # not with templates yet


def reference_losses() -> list[float]:
    return spawn(run_pretrain, world=1, args=(ARGS,))[0]


def test_templates_train_as_one_process_and_resume_on_a_grid(tmp_path):
    reference = reference_losses()
    ckpt = str(tmp_path / "ckpt")
    hetero = ARGS + ["--heterogeneous-pipelines", "3", "2", "--exit-interval", "4"]
    hetero += ["--save", ckpt, "--save-interval", "4", "--elastic-control-port", str(free_port())]
    results = spawn(run_pretrain, world=5, args=(hetero,), timeout_s=180)
    losses = merged_losses(results, reference[:4])  # the logging rank's, iterations 1-4
    assert sorted(losses) == [1, 2, 3, 4]
    drawn = Counter(s for r in results for s in r["samples"])
    assert sorted(drawn) == list(range(4 * STEP)) and set(drawn.values()) == {1}
    resumed = spawn(
        run_pretrain,
        world=2,
        args=(ARGS + ["--pipeline-model-parallel-size", "2", "--load", ckpt],),
    )[1]  # the last stage logs
    for want, got in zip(reference[4:], resumed, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def drive(port: int, commands: list[list[str]], out: dict) -> None:
    base = [sys.executable, "tools/elastic_ctl.py", "--port", str(port), "--timeout", "120"]
    for name, cmd in commands:
        out[name] = subprocess.run(base + cmd, capture_output=True, text=True)


def live_job(rank, world, argv, port, commands):
    import pretrain_gpt

    if rank != 0:
        return pretrain_gpt.main(list(argv))
    answers: dict = {}
    t = threading.Thread(target=drive, args=(port, commands, answers), daemon=True)
    t.start()
    out = pretrain_gpt.main(list(argv))
    t.join(timeout=120)
    out["tool"] = {k: (v.returncode, v.stdout + v.stderr) for k, v in answers.items()}
    return out


def test_live_changes_between_a_grid_and_templates():
    reference = reference_losses()
    port = free_port()
    argv = ARGS + ["--pipeline-model-parallel-size", "2", "--elastic-initial-members", "4"]
    argv += ["--heterogeneous-pipelines", "--elastic-control-port", str(port)]
    commands = [
        ("five", ["layout", "--pipelines", "3", "2", "--at-iteration", "2"]),
        ("show", ["show"]),
        ("three", ["scale", "3", "--at-iteration", "5"]),
    ]
    results = spawn(live_job, world=5, args=(argv, port, commands), timeout_s=240)
    tool = results[0]["tool"]
    assert tool["five"][0] == 0 and '"new": "tp1x[pp3+pp2]"' in tool["five"][1], tool["five"]
    assert tool["three"][0] == 0 and '"new": "tp1x[' in tool["three"][1], tool["three"]
    assert "replica 1: 2 stages" in tool["show"][1], tool["show"]
    merged_losses(results, reference)
    drawn = Counter(s for r in results for s in r["samples"])
    assert sorted(drawn) == list(range(10 * STEP)) and set(drawn.values()) == {1}
