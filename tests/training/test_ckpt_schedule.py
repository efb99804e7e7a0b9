"""Resuming with other schedule flags (--train-iters, --lr, ...): refused unless one of
Megatron's two flags says whose schedule goes on; the same flags resume as before."""

import json
import os

import pytest
from test_checkpoint_faults import error_line  # noqa: E402
from test_training_run import close, train  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run of 6 iterations checkpointed at 3 (iter_0000003), and its losses."""
    save = str(tmp_path_factory.mktemp("sched") / "ckpt")
    losses = train(1, "--save", save, "--save-interval", "3")
    return os.path.join(save, "iter_0000003"), losses


def test_another_train_iters_is_refused_naming_both_values(saved):
    with pytest.raises(RuntimeError) as err:  # before: trained on with another schedule
        train(1, "--load", saved[0], "--train-iters", "8")
    line = error_line(err)
    assert "--train-iters: " in line and "lr_decay_steps 6" in line and "8" in line, line
    assert "--override-opt_param-scheduler" in line, line
    assert "--use-checkpoint-opt_param-scheduler" in line, line


@pytest.mark.parametrize(
    "flag,decay",
    [("--override-opt_param-scheduler", 8), ("--use-checkpoint-opt_param-scheduler", 6)],
)
def test_megatrons_flags_say_whose_schedule_goes_on(saved, tmp_path, flag, decay):
    out = str(tmp_path / "out")
    args = ["--load", saved[0], "--train-iters", "8", flag, "--save", out, "--save-interval", "8"]
    losses = train(1, *args)
    with open(os.path.join(out, "iter_0000008", "megadyn.json")) as f:
        schedule = json.load(f)["scheduler"]
    assert schedule["lr_decay_steps"] == decay and schedule["num_steps"] == 8, schedule
    assert len(losses) == 5
    if decay == 6:  # the checkpoint's schedule: iterations 4-6 are the original run's
        close(losses[:3], saved[1][3:])
    else:  # the loss of iteration 4 comes before the first step under the new schedule
        close(losses[:1], saved[1][3:4])
        assert abs(losses[1] - saved[1][4]) > 1e-6 * abs(saved[1][4])
