"""The reference run the end-to-end tests of this directory compare with, trained once."""

import pytest
from test_training_run import train


@pytest.fixture(scope="session")
def single():
    """The losses of test_training_run.py's job (COMMON) on one process: dp 1, 4 micro batches
    a step."""
    return train(1)
