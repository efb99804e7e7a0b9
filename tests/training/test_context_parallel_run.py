"""pretrain_gpt.py's job at --context-parallel-size 2 trains like cp 1: the same losses with
the distributed optimizer sharded over dp x cp, and its checkpoint resumes at cp 1."""

import os

from tests.training.test_training_run import close, train


def test_cp2_with_distributed_optimizer_trains_like_cp1_and_resumes_at_cp1(tmp_path):
    save = str(tmp_path / "ckpt")
    single = train(1)  # dp 1, 4 micro batches per step
    cp2 = train(
        2,
        "--context-parallel-size",
        "2",
        "--use-distributed-optimizer",
        "--save",
        save,
        "--save-interval",
        "3",
    )
    close(cp2, single)
    resumed = train(1, "--load", os.path.join(save, "iter_0000003"))  # cp 2 -> cp 1
    close(resumed, single[3:])
