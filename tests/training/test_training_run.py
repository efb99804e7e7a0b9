"""End-to-end training through pretrain_gpt.main on CPU: resume under other layouts, the
distributed optimizer, data-parallel equivalence, W&B offline logging, the metrics file."""

import os
import re

import pytest

from megadyn.testing import run_pretrain, spawn
from tests.tiny import TRAINING, tiny_args

JOB = {**TRAINING, "num_layers": 4, "train_iters": 6}
"""The job of these tests: TRAINING at 4 layers, 6 steps of 4 samples."""
COMMON = tiny_args(JOB)


def train(world, *flags):
    results = spawn(run_pretrain, world=world, args=(COMMON + list(flags),))
    return next(r.history for r in reversed(results) if r.history)  # the logging (last) rank's


def close(a, b, rtol=1e-5):
    assert len(a) == len(b), (a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= rtol * abs(y), (a, b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("ref") / "ckpt")
    losses = train(2, "--tensor-model-parallel-size", "2", "--save", save, "--save-interval", "3")
    return losses, save


@pytest.mark.parametrize(
    "world,layout",
    [
        (2, ["--tensor-model-parallel-size", "2"]),
        (2, ["--pipeline-model-parallel-size", "2"]),
        (2, ["--use-distributed-optimizer"]),  # dp 2
        (
            2,
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
        ),
    ],
    ids=["same-tp2", "pp2", "dp2-distopt", "pp2-vpp2"],
)
def test_resume_under_any_layout_matches_uninterrupted(reference, world, layout):
    losses, save = reference
    resumed = train(world, *layout, "--load", os.path.join(save, "iter_0000003"))
    close(resumed, losses[3:])


def test_distributed_optimizer_and_dp_equivalence(single):  # dp 1, 4 micro batches
    plain = train(2, "--tensor-model-parallel-size", "1")  # dp 2, 2 micro batches each
    dist_opt = train(2, "--use-distributed-optimizer")
    # the updated params arrive during the next forward instead of right after the step
    overlapped = train(
        2, "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"
    )
    close(dist_opt, plain)
    close(plain, single)
    assert overlapped == dist_opt


def test_wandb_offline_run_holds_losses(tmp_path, monkeypatch):
    from megadyn.training.wandb_logger import read_offline_history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    losses = train(
        1,
        "--wandb-project",
        "megadyn-test",
        "--wandb-exp-name",
        "t",
        "--wandb-save-dir",
        str(tmp_path),
    )
    runs = [p for p in tmp_path.rglob("offline-run-*") if p.is_dir()]
    assert len(runs) == 1
    logged = [row["lm loss"] for row in read_offline_history(runs[0]) if "lm loss" in row]
    close(logged, losses, rtol=1e-6)


def test_metrics_file_holds_the_printed_losses_across_a_resume(tmp_path, capfd):
    """The logging rank alone appends one record per --log-interval to <--save>/metrics.jsonl,
    with the lm loss printed in the iteration line; a run resumed after a kill that cut the last
    line short goes on in the same file."""
    from megadyn.training.metrics_log import read_metrics

    save = str(tmp_path / "ckpt")
    flags = ("--log-interval", "2", "--save", save, "--save-interval", "2")
    train(2, *flags, "--exit-interval", "4")  # records at iterations 2 and 4
    path = os.path.join(save, "metrics.jsonl")
    with open(path, "a") as f:
        f.write('{"record": "iteration", "time": "2026-11-26T17:30:01", "iteration": 5, "lo')
    train(2, *flags, "--load", save)  # from iteration 4: a record at 6
    printed = re.findall(r" iteration +(\d+)/ +6 \|.*? lm loss: (\S+) \|", capfd.readouterr().out)
    records = read_metrics(path)
    assert [r["iteration"] for r in records] == [2, 4, 6]
    assert [(str(r["iteration"]), f"{r['losses']['lm loss']:.6E}") for r in records] == printed
    assert [r["consumed_samples"] for r in records] == [8, 16, 24]
    assert all(r["record"] == "iteration" and r["train_iters"] == 6 for r in records)


def test_the_loss_scale_reaches_the_backward_pass():
    """The optimizer unscales gradients by the loss scale, so the loss back-propagated must have
    been multiplied by it: with a constant power-of-two scale the run is the unscaled run, and
    fp16 follows fp32. (Gradients unscaled without having been scaled would be 2^-16 of the true
    ones; against Adam's epsilon of 1e-4 the loss would barely move.)"""
    eps = ("--adam-eps", "1e-4")
    fp32 = train(1, *eps)
    close(train(1, *eps, "--loss-scale", "65536"), fp32)
    fp16 = train(1, *eps, "--fp16", "--loss-scale", "4096")
    close(fp16, fp32, rtol=2e-2)
    assert fp32[-1] < fp32[0] - 0.05, fp32


def test_recomputation_in_bf16_trains_like_no_recomputation():
    """bf16 adds weight gradients straight into the fp32 main_grad (gradient-accumulation
    fusion): under full recomputation the backward sees the recomputed forward's copies of
    the weights, and must still reach the parameters' main_grad. Recomputation replays the
    same operations, so the losses are equal."""
    bf16 = ("--bf16", "--tensor-model-parallel-size", "2")
    plain = train(2, *bf16)
    full = ("--recompute-granularity", "full", "--recompute-method", "uniform")
    close(train(2, *bf16, *full, "--recompute-num-layers", "1"), plain)
    close(train(2, *bf16, "--recompute-granularity", "selective"), plain)


def test_deterministic_mode_switches_torch_and_keeps_the_losses(single, capfd):
    """--deterministic-mode turns torch's deterministic algorithms on (warn_only=False: the
    attention backward then takes its kernel without atomics) and says so in one line; on the
    CPU, already deterministic, the losses are the run's without it, bit for bit."""
    results = spawn(_deterministic_run, world=1, args=(COMMON + ["--deterministic-mode"],))
    enabled, warn_only, history = results[0]
    assert (enabled, warn_only) == (True, False)
    assert history == single
    assert "deterministic mode: torch.use_deterministic_algorithms(True)" in capfd.readouterr().out


def _deterministic_run(rank, world, argv):
    import torch

    history = run_pretrain(rank, world, argv).history
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    return (*flags, history)


def test_precision_aware_optimizer_resumes_with_or_without_the_flag(tmp_path):
    """--use-precision-aware-optimizer (bf16 weight + remainder, no fp32 main copy) saves the
    fp32 main weights as a run without it does: a resume with the flag goes on as its run, one
    without it from the same main weights (bf16 weights cast where it rounded a tie) closely."""
    flags = ("--bf16", "--use-distributed-optimizer")
    save = str(tmp_path / "ckpt")
    pa = ("--use-precision-aware-optimizer",)
    losses = train(2, *flags, *pa, "--save", save, "--save-interval", "3")
    close(losses, train(2, *flags), rtol=1e-2)
    ckpt = os.path.join(save, "iter_0000003")
    close(train(2, *flags, *pa, "--load", ckpt), losses[3:], rtol=1e-6)
    close(train(2, *flags, "--load", ckpt), losses[3:], rtol=1e-2)
