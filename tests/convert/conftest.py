"""A checkpoint trained by pretrain_gpt.py (tp 2, with optimizer state), shared by the tests."""

import pytest
from convert_helpers import TRAIN, train


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """(save root holding iter_0000003 and iter_0000006, the losses of the 6 steps); the job is
    TRAIN + --train-iters 6 at tp 2."""
    save = str(tmp_path_factory.mktemp("trained") / "ckpt")
    flags = ["--tensor-model-parallel-size", "2", "--train-iters", "6"]
    losses = train(2, TRAIN + flags + ["--save", save, "--save-interval", "3"])
    return save, losses
