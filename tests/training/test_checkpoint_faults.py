"""Checkpoints survive a crash mid-save; bad checkpoints give clear errors."""

import os

import pytest
from test_training_run import COMMON, close, train  # noqa: E402

from megadyn.testing import run_pretrain, spawn
from megadyn.training.checkpoint import latest_checkpoint


def crash_on_second_save(rank, world, argv):
    import pretrain_gpt
    from megadyn.training import checkpoint

    dcp = checkpoint.dcp()  # the torch.distributed.checkpoint module
    real_save = dcp.save

    def save(items, checkpoint_id, **kw):
        if "0000004" in checkpoint_id:
            os.makedirs(checkpoint_id, exist_ok=True)
            with open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb") as f:
                f.write(b"half a shard")
            os._exit(9)  # killed in the middle of writing
        return real_save(items, checkpoint_id=checkpoint_id, **kw)

    dcp.save = save
    return pretrain_gpt.main(list(argv))


def test_kill_mid_save_keeps_previous_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    flags = COMMON + ["--save", save, "--save-interval", "2"]
    with pytest.raises(RuntimeError, match="exited"):
        spawn(crash_on_second_save, world=1, args=(flags,))
    assert latest_checkpoint(save) == os.path.join(save, "iter_0000002")
    resumed = train(1, "--load", save)
    reference = train(1)
    close(resumed, reference[2:])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("c") / "ckpt")
    train(1, "--save", save, "--save-interval", "6")
    return save


def test_truncated_checkpoint_is_a_clear_error(saved, tmp_path):
    import shutil

    broken = str(tmp_path / "broken")
    shutil.copytree(saved, broken)
    shard = next(
        p for p in os.listdir(os.path.join(broken, "iter_0000006")) if p.endswith(".distcp")
    )
    path = os.path.join(broken, "iter_0000006", shard)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(RuntimeError, match="--load"):
        train(1, "--load", broken)


def test_model_shape_mismatch_is_a_clear_error(saved):
    bigger = [a if a != "32" else "64" for a in COMMON]  # --hidden-size 64
    with pytest.raises(RuntimeError, match="global shape"):
        spawn(run_pretrain, world=1, args=(bigger + ["--load", saved],))


def test_async_save_keeps_last_k(tmp_path):
    save = str(tmp_path / "ckpt")
    losses = train(
        1, "--save", save, "--save-interval", "2", "--ckpt-keep-last", "2", "--async-save"
    )
    assert sorted(d for d in os.listdir(save) if d.startswith("iter_")) == [
        "iter_0000004",
        "iter_0000006",
    ]
    assert not [d for d in os.listdir(save) if d.endswith(".partial")]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "6"
    resumed = train(1, "--load", os.path.join(save, "iter_0000004"))
    close(resumed, losses[4:])
