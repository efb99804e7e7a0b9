"""Checkpoints survive a crash mid-save; bad checkpoints give clear errors."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_training_run import COMMON, JOB, close, train  # noqa: E402

from megadyn.testing import free_port, run_pretrain, spawn
from megadyn.testing.damage import flip_bytes
from megadyn.training.checkpoint import CheckpointError
from megadyn.training.checkpoint_dirs import (
    TRACKER,
    checkpoint_at_step,
    find_checkpoint,
    latest_checkpoint,
)
from tests.tiny import tiny_args


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


def test_kill_mid_save_keeps_previous_checkpoint(tmp_path, single):
    save = str(tmp_path / "ckpt")
    flags = COMMON + ["--save", save, "--save-interval", "2"]
    with pytest.raises(RuntimeError, match="exited"):
        spawn(crash_on_second_save, world=1, args=(flags,))
    assert latest_checkpoint(save) == os.path.join(save, "iter_0000002")
    resumed = train(1, "--load", save)
    close(resumed, single[2:])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run of 6 iterations checkpointed at 3 and 6 (the tracker names 6), and its losses."""
    save = str(tmp_path_factory.mktemp("c") / "ckpt")
    losses = train(1, "--save", save, "--save-interval", "3")
    return save, losses


def truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def overwrite(path: str) -> None:
    """Same length, other bytes (as a disk or a copy gone wrong leaves a file)."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.write(bytes(range(256)) * (size // 256) + bytes(size % 256))


def without_checksums(directory: str) -> None:
    """megadyn.json as megadyn wrote it before checksums were recorded."""
    with open(os.path.join(directory, "megadyn.json")) as f:
        meta = json.load(f)
    del meta["checksums"]
    with open(os.path.join(directory, "megadyn.json"), "w") as f:
        json.dump(meta, f)


def overwrite_unrecorded(path: str) -> None:
    """`overwrite` in a checkpoint without checksums: only decoding the bytes finds it."""
    overwrite(path)
    without_checksums(os.path.dirname(path))


def damaged_copy(saved, tmp_path, damage) -> tuple[str, str]:
    """A copy of the saved run whose newest checkpoint has one shard damaged; (root, shard)."""
    root = str(tmp_path / "damaged")
    shutil.copytree(saved[0], root)
    newest = os.path.join(root, "iter_0000006")
    shard = sorted(p for p in os.listdir(newest) if p.endswith(".distcp"))[0]
    if damage is not None:
        damage(os.path.join(newest, shard))
    return root, shard


def error_line(err) -> str:
    """The exception line of a spawned rank's traceback (what the user is told)."""
    return [line for line in str(err.value).splitlines() if line.strip()][-1]


@pytest.mark.parametrize(
    "damage,what",
    [
        (truncate, r"is short by \d+ bytes"),
        (overwrite, "fails its checksum in tensor"),
        (overwrite_unrecorded, "is unreadable"),
    ],
)
def test_a_damaged_newest_checkpoint_is_an_error_naming_the_file(saved, tmp_path, damage, what):
    root, shard = damaged_copy(saved, tmp_path, damage)
    with pytest.raises(RuntimeError) as err:
        train(1, "--load", root)  # before: resumed from iteration 3 without a word
    line = error_line(err)
    assert re.search(re.escape(os.path.join("iter_0000006", shard)) + " " + what, line), line
    assert "--ckpt-step 3" in line and os.path.join(root, "iter_0000003") in line, line
    assert "lacks" not in line and "weights_only" not in str(err.value), line


def test_a_tracker_naming_a_missing_directory_is_an_error(saved, tmp_path):
    root, _ = damaged_copy(saved, tmp_path, None)
    shutil.rmtree(os.path.join(root, "iter_0000006"))
    with pytest.raises(RuntimeError) as err:
        train(1, "--load", root)
    line = error_line(err)
    assert f"{os.path.join(root, 'iter_0000006')} does not exist" in line, line
    assert "--ckpt-step 3" in line, line


def test_ckpt_step_resumes_from_an_older_checkpoint_on_purpose(saved, tmp_path):
    root, _ = damaged_copy(saved, tmp_path, truncate)
    close(train(1, "--load", root, "--ckpt-step", "3"), saved[1][3:])


def test_which_checkpoint_load_names(saved, tmp_path):
    """The tracker's directory or an error; an iter_* directory itself; without a tracker the
    newest complete one (a directory renamed into place but damaged since is passed over)."""
    root, shard = damaged_copy(saved, tmp_path, truncate)
    older = os.path.join(root, "iter_0000003")
    with pytest.raises(CheckpointError, match=r"iter_0000006/__\S+ is short by"):
        find_checkpoint(root)
    assert find_checkpoint(older) == older
    with pytest.raises(CheckpointError, match="iter_0000004: no such directory"):
        find_checkpoint(checkpoint_at_step(root, 4))
    assert checkpoint_at_step(root, 3) == older
    os.remove(os.path.join(root, TRACKER))
    assert find_checkpoint(root) == older
    shutil.copytree(saved[0], root, dirs_exist_ok=True)  # whole again
    os.remove(os.path.join(root, TRACKER))
    assert find_checkpoint(root) == os.path.join(root, "iter_0000006")
    assert find_checkpoint(str(tmp_path / "empty")) is None  # nothing there: train from scratch
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write("sixty")
    with pytest.raises(CheckpointError, match="not an iteration"):
        find_checkpoint(root)
    for name in (".metadata", "megadyn.json"):  # the small files, damaged at their size
        overwrite(os.path.join(older, name))
        with pytest.raises(CheckpointError, match=f"iter_0000003/{re.escape(name)} is unreadable"):
            find_checkpoint(older)


REPO = Path(__file__).resolve().parents[2]


def cli(tool: str, *args: str) -> tuple[int, str]:
    """Run `python <tool> args` from the repository as a user does; (exit code, output)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("MEGADYN_DEBUG", None)
    cmd = [sys.executable, tool, *args]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


def test_bytes_changed_inside_a_tensor_fail_the_load_naming_file_and_tensor(saved, tmp_path):
    """Before: 16 bytes flipped inside a tensor loaded with exit code 0 and other losses."""
    root, _ = damaged_copy(saved, tmp_path, None)
    newest = os.path.join(root, "iter_0000006")
    shard, key = flip_bytes(newest, "optim.decoder.layers.1.mlp.linear_fc1.weight")
    code, out = cli("pretrain_gpt.py", *COMMON, "--load", root)
    said = [line for line in out.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert code == 2 and len(said) == 1 and "Traceback" not in out, out
    assert f"--load {newest}: {os.path.join(newest, shard)} fails its checksum" in said[0], out
    assert f"in tensor {key} " in said[0] and "--ckpt-step 3" in said[0], out
    # convert_checkpoint.py reads megadyn checkpoints through the same check
    code, out = cli(
        "tools/convert_checkpoint.py", "--loader", "megadyn", "--saver", "megadyn",
        "--load-dir", root, "--save-dir", str(tmp_path / "out"),
    )  # fmt: skip
    said = f"convert_checkpoint.py: error: --load-dir {newest}: {os.path.join(newest, shard)}"
    assert code == 2 and f"{said} fails its checksum in tensor {key} " in out, out
    assert "Traceback" not in out and not os.path.exists(tmp_path / "out"), out


def test_a_checkpoint_saved_without_checksums_loads_unverified(saved, tmp_path, capfd):
    root, _ = damaged_copy(saved, tmp_path, None)
    older = os.path.join(root, "iter_0000003")
    without_checksums(older)
    close(train(1, "--load", older), saved[1][3:])
    out = capfd.readouterr().out
    assert f"{older}: not verified (saved before megadyn recorded checksums)" in out, out
    assert re.search(r"loaded checkpoint .* read in [\d.]+ s \(checksum_s 0\.00\)", out), out


def test_model_shape_mismatch_is_a_clear_error(saved):
    bigger = tiny_args(JOB, hidden_size=64)
    with pytest.raises(RuntimeError, match="global shape"):
        spawn(run_pretrain, world=1, args=(bigger + ["--load", saved[0]],))


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


def test_precision_aware_optimizer_through_the_cli(tmp_path):
    """`python pretrain_gpt.py --bf16 --use-precision-aware-optimizer` as a user runs it: a
    run that saves, a resume of it from its older checkpoint, a resume from a checkpoint truncated since (one error line
    naming the file and the older checkpoint, no traceback, exit 2), and the flag without
    --bf16 refused naming it."""
    save = str(tmp_path / "ckpt")
    flags = [*COMMON, "--bf16", "--use-precision-aware-optimizer"]
    code, out = cli("pretrain_gpt.py", *flags, "--save", save, "--save-interval", "3")
    assert code == 0 and latest_checkpoint(save) == os.path.join(save, "iter_0000006"), out
    code, out = cli("pretrain_gpt.py", *flags, "--load", save, "--ckpt-step", "3")
    done = [int(i) for i in re.findall(r" iteration +(\d+)/ *6\b", out)]
    assert code == 0 and done == [4, 5, 6], out  # resumed after iteration 3
    newest = os.path.join(save, "iter_0000006")
    shard = sorted(p for p in os.listdir(newest) if p.endswith(".distcp"))[0]
    truncate(os.path.join(newest, shard))
    code, out = cli("pretrain_gpt.py", *flags, "--load", save)
    said = [line for line in out.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert code == 2 and len(said) == 1 and "Traceback" not in out, out
    assert f"{os.path.join(newest, shard)} is short by" in said[0], out
    assert "--ckpt-step 3" in said[0], out
    code, out = cli("pretrain_gpt.py", *COMMON, "--use-precision-aware-optimizer")
    assert code == 2 and "--use-precision-aware-optimizer" in out and "Traceback" not in out, out


def test_cross_entropy_chunks_through_the_cli():
    """`python pretrain_gpt.py --cross-entropy-chunks 3` as a user runs it trains the losses of
    the run without it; 0 chunks is refused naming the flag, without a traceback."""

    def losses(*flags):
        code, out = cli("pretrain_gpt.py", *COMMON, "--untie-embeddings-and-output-weights", *flags)
        assert code == 0, out
        return [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", out)]

    whole, chunked = losses(), losses("--cross-entropy-chunks", "3")
    assert len(whole) == 6 and chunked == pytest.approx(whole, rel=1e-5)
    code, out = cli("pretrain_gpt.py", *COMMON, "--cross-entropy-chunks", "0")
    assert code == 2 and "--cross-entropy-chunks must be >= 1" in out and "Traceback" not in out


def test_keep_flags_of_the_fused_llama_through_the_cli(tmp_path):
    """`python pretrain_gpt.py --pointwise-fusion` on a Llama as a user runs it, with
    --keep-norm-outputs and --keep-fc2-input (the linear layers keep their inputs instead of
    computing them again; the pre-MLP norm joins the residual add): the same losses; and an
    operator who saved with the flags and resumes without them (memory ran short) trains
    iterations 4-6 to those losses too."""
    llama = [
        *COMMON,
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--disable-bias-linear",
        "--pointwise-fusion",
    ]

    def losses(*flags):
        code, out = cli("pretrain_gpt.py", *llama, *flags)
        assert code == 0, out
        return [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", out)]

    save = str(tmp_path / "ckpt")
    keep = ["--keep-norm-outputs", "--keep-fc2-input"]
    recomputed, kept = losses(), losses(*keep, "--save", save, "--save-interval", "3")
    assert len(recomputed) == 6 and kept == pytest.approx(recomputed, rel=1e-6)
    resumed = losses("--load", save, "--ckpt-step", "3")
    assert resumed == pytest.approx(kept[3:], rel=1e-6)


def test_sharded_gradients_and_loss_chunks_under_torchrun(tmp_path):
    """As an operator runs them, `torchrun --nproc-per-node 2 pretrain_gpt.py` at dp 2: a run
    with --data-parallel-sharding-strategy optim_grads and --cross-entropy-chunks that saves;
    a resume of its older checkpoint with both flags dropped (ZeRO-1, whole logits) that trains
    iterations 4-6 to its losses; the newest checkpoint truncated since: one error line naming
    the file, no frame of ours."""

    def torchrun(*args: str) -> tuple[int, str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        cmd += ["--master-port", str(free_port()), "pretrain_gpt.py", *COMMON]
        cmd += ["--use-distributed-optimizer", "--overlap-grad-reduce", *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.pop("MEGADYN_DEBUG", None)
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
        return done.returncode, done.stdout + done.stderr

    def losses(out: str) -> dict[int, float]:
        found = re.findall(r" iteration +(\d+)/ *6 .*?lm loss: ([0-9.E+-]+)", out)
        return {int(it): float(loss) for it, loss in found}

    save = str(tmp_path / "ckpt")
    zero2 = ["--data-parallel-sharding-strategy", "optim_grads", "--cross-entropy-chunks", "3"]
    code, out = torchrun(*zero2, "--save", save, "--save-interval", "3")
    first = losses(out)
    assert code == 0 and sorted(first) == [1, 2, 3, 4, 5, 6], out
    code, out = torchrun("--load", save, "--ckpt-step", "3")
    resumed = losses(out)
    assert code == 0 and sorted(resumed) == [4, 5, 6], out
    for it, loss in resumed.items():  # fp32 sums in another order: ZeRO-1, whole GEMMs
        assert loss == pytest.approx(first[it], rel=1e-4), (it, first, resumed)
    newest = os.path.join(save, "iter_0000006")
    shard = sorted(p for p in os.listdir(newest) if p.endswith(".distcp"))[0]
    truncate(os.path.join(newest, shard))
    code, out = torchrun(*zero2, "--load", save)
    said = {line for line in out.splitlines() if line.startswith("pretrain_gpt.py: error:")}
    assert code != 0 and len(said) == 1, out
    assert f"{os.path.join(newest, shard)} is short by" in said.pop(), out
    assert not re.search(r"File \"\S*(megadyn|pretrain_gpt)", out), out  # no frame of ours


def test_the_clip_in_the_update_and_the_embedding_rows_through_the_cli(tmp_path):
    """`python pretrain_gpt.py --bf16 --untie-embeddings-and-output-weights
    --use-precision-aware-optimizer` with a clip that acts (--clip-grad 0.05, gradient norms
    near 4) as a user runs it:
    - the update that takes the clip as it reads the gradients trains the losses of fp32 main
      weights clipped by a pass of their own, to 1e-5 (without the clip they move 1e-3 apart);
    - the embedding's gradient added into main_grad row by row trains the losses of
      --no-gradient-accumulation-fusion's dense bf16 table gradient, to 1e-4;
    - an operator resumes the run from iteration 3 to the same losses, and a truncated newest
      checkpoint is refused in one line naming the file, with no frame of ours."""
    base = [*COMMON, "--bf16", "--untie-embeddings-and-output-weights", "--clip-grad", "0.05"]

    def run(*flags: str) -> tuple[int, str]:
        return cli("pretrain_gpt.py", *base, *flags)

    def losses(*flags: str) -> list[float]:
        code, out = run(*flags)
        assert code == 0, out
        return [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", out)]

    save = str(tmp_path / "ckpt")
    aware = ["--use-precision-aware-optimizer"]
    fused = losses(*aware, "--save", save, "--save-interval", "3")
    assert len(fused) == 6
    assert losses() == pytest.approx(fused, rel=1e-5)  # fp32 main weights, the clip a pass
    assert losses(*aware, "--no-gradient-accumulation-fusion") == pytest.approx(fused, rel=1e-4)
    assert losses(*aware, "--load", save, "--ckpt-step", "3") == pytest.approx(fused[3:], rel=1e-6)
    newest = os.path.join(save, "iter_0000006")
    shard = sorted(p for p in os.listdir(newest) if p.endswith(".distcp"))[0]
    truncate(os.path.join(newest, shard))
    code, out = run(*aware, "--load", save)
    said = [line for line in out.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert code != 0 and len(said) == 1, out
    assert f"{os.path.join(newest, shard)} is short by" in said[0], out
    assert not re.search(r"File \"\S*(megadyn|pretrain_gpt)", out), out  # no frame of ours
