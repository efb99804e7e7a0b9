"""--sample-per-document with --micro-batch-tokens: the loss is the mean over the global
batch's real tokens, so token budgets that group the same samples differently, and dp 2 against
dp 1, give the same losses and gradients; pretrain_gpt.py trains with them end to end and a
resume at dp 1 goes on with the next samples; what cannot run with them yet is refused by
name."""

import math
import shlex

import numpy as np
import pytest

from megadyn.testing import run_pretrain, spawn
from megadyn.testing.corpus import write_corpus
from megadyn.training.arguments import parse_args
from megadyn.training.config import ConfigError
from tests.tiny import REPEATABLE, RUN, tiny_args


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """200 documents of 2..40 counting tokens (so --seq-length 16 cuts many), preprocessed with
    tools/preprocess_data.py (NullTokenizer, EOD appended)."""
    rng = np.random.default_rng(0)
    texts = []
    for _ in range(200):
        start, n = int(rng.integers(0, 60)), int(rng.integers(2, 40))
        texts.append(" ".join(str((start + i) % 60) for i in range(n)))
    return write_corpus(tmp_path_factory.mktemp("varlen"), texts, vocab_size=60)


JOB = {
    **RUN,
    **REPEATABLE,
    "num_layers": 4,
    "make_vocab_size_divisible_by": 8,
    "mock_data": None,
    "split": "90,10,0",
    "sample_per_document": True,
    "micro_batch_size": None,
    "global_batch_size": 8,
    "lr": "1e-2",
    "clip_grad": 0,
    "train_iters": 2,
}
"""A 4-layer model on the corpus: one document a sample, 8 samples a step (each test names its
token budget, --micro-batch-tokens)."""


def flags(prefix: str, **overrides) -> list[str]:
    return tiny_args(JOB, data_path=prefix, **overrides)


def budget_steps(rank, world, argv, budgets):
    """Two steps under each token budget: losses, the first step's gradients, its micro
    batches."""
    from megadyn.core.groups import ParallelGroups
    from megadyn.training.trainer import Trainer

    out = []
    for budget in budgets:
        cfg = parse_args(argv + ["--micro-batch-tokens", str(budget)], world_size=world)
        groups = ParallelGroups.build(cfg.layout(world), range(world))
        trainer = Trainer(cfg, groups, "cpu", print_fn=lambda *a, **k: None)
        count = len(trainer.train_loader.step_at(0, 8).batches)
        losses = [trainer.train_step().loss.item()]
        grads = {n: p.main_grad.numpy().copy() for n, p in trainer.chunks[0].named_parameters()}
        losses.append(trainer.train_step().loss.item())  # after an update from those gradients
        groups.destroy()
        out.append((losses, grads, count))
    return out


def test_token_budgets_and_dp_give_the_same_losses_and_gradients(corpus):
    argv = flags(corpus)
    one = spawn(budget_steps, world=1, args=(argv, [16, 40, 1000]))[0]
    two = spawn(budget_steps, world=2, args=(argv, [24]))
    counts = [count for _, _, count in one]
    assert counts[0] > counts[1] > counts[2] == 1, counts  # different groupings of 8 samples
    reference_losses, reference_grads, _ = one[0]
    for losses, grads, _ in one[1:] + [two[0][0], two[1][0]]:
        np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
        for name, grad in grads.items():
            scale = np.abs(reference_grads[name]).max() + 1e-12
            assert np.abs(grad - reference_grads[name]).max() <= 1e-5 * scale, name


def test_pretrain_gpt_trains_with_variable_lengths_and_resumes_under_another_dp(corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    argv = flags(corpus, train_iters=None) + shlex.split(
        "--train-iters 16 --micro-batch-tokens 32 --eval-interval 8 --eval-iters 1 "
        f"--save {save} --save-interval 8"
    )
    results = spawn(run_pretrain, world=2, args=(argv,))
    losses = next(r.history for r in reversed(results) if r.history)
    assert len(losses) == 16 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4]), losses
    # from the checkpoint of iteration 8 at dp 1 and another budget: the same next samples
    resumed_argv = argv + ["--load", save, "--ckpt-step", "8", "--micro-batch-tokens", "48"]
    resumed = spawn(run_pretrain, world=1, args=(resumed_argv,))[0].history
    np.testing.assert_allclose(resumed, losses[8:], rtol=1e-5)


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--micro-batch-tokens 64", "--sample-per-document does not run with --pipeline"),
        ("--micro-batch-tokens 8", "--micro-batch-tokens (8) must be at least --seq-length"),
        ("--micro-batch-size 1", "--sample-per-document and --micro-batch-tokens go"),
    ],
)
def test_what_cannot_run_is_refused_by_name(extra, message):
    argv = flags("d") + shlex.split(f"--pipeline-model-parallel-size 2 {extra}")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_args(argv, world_size=2)
    blend = flags("d") + shlex.split("--data-path 1 a 1 b --micro-batch-tokens 64")
    with pytest.raises(ConfigError, match="does not run with a blend of --data-path"):
        parse_args(blend, world_size=1)
    cp = flags("d") + shlex.split("--context-parallel-size 2 --micro-batch-tokens 64")
    with pytest.raises(ConfigError, match="--context-parallel-size > 1 does not run with --s"):
        parse_args(cp, world_size=2)


def test_the_layout_planner_keeps_one_stage_and_no_cp():
    from megadyn.core.layout import Layout, LayoutError
    from megadyn.elastic.planning.requests import check_layout, plan_layout

    cfg = parse_args(flags("d") + ["--micro-batch-tokens", "64"], world_size=1)
    for members in (2, 4, 8):  # without --sample-per-document: pp 2, pp 4, tp 2 x pp 4
        layout = plan_layout(cfg.model, cfg, members, device_type="cpu", gpu_memory_gib=80)
        assert layout.pp == layout.cp == 1, layout
    with pytest.raises(LayoutError, match="--sample-per-document"):
        check_layout(Layout(pp=2), cfg.model, cfg)
