"""One failure, one message (megadyn/launch/errors.py): under real torchrun a damaged data
file on one rank prints one line, the rank waiting for it nothing, and MEGADYN_DEBUG=1 brings
the tracebacks back; the kinds of errors and the ranks' agreement through the agent's store."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from megadyn.data.indexed_dataset import IndexedDatasetWriter
from megadyn.launch import errors
from megadyn.testing import free_port
from megadyn.training.config import ConfigError
from tests.tiny import tiny_args

REPO = Path(__file__).resolve().parents[2]
TINY = tiny_args(mock_data=None, train_iters=4, eval_interval=0)  # the tests add --data-path
GLOO_PEER_LOST = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:60108. This is typically caused by a remote worker crashing."
)


# --- torchrun end to end -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def truncated_corpus(tmp_path_factory) -> str:
    """A dataset whose .bin lost its last 1,000 bytes (a copy cut short); its prefix."""
    prefix = str(tmp_path_factory.mktemp("data") / "corpus")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(40):
            writer.add_document(rng.integers(0, 60, 200))
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".bin") - 1000)
    return prefix


def torchrun(args: list[str], **env) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(free_port()), "pretrain_gpt.py", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    return done.returncode, done.stdout + done.stderr


def test_a_damaged_data_file_is_one_message_under_torchrun(truncated_corpus, monkeypatch):
    monkeypatch.delenv(errors.DEBUG_ENV, raising=False)
    code, out = torchrun([*TINY, "--data-path", truncated_corpus])
    # rank 0 reads the dataset first, rank 1 waits for it in a barrier
    said = [line for line in out.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert code != 0 and len(said) == 1, out
    assert re.search(
        re.escape(truncated_corpus + ".bin") + r": truncated token file: .* ends at offset 15000"
        r" \(a dataset of --data-path; write it again with tools/preprocess_data.py\)$",
        said[0],
    ), said[0]
    assert "Connection closed by peer" not in out, out
    assert out.count("Traceback") == 1 and "ChildFailedError" in out.split("Traceback")[1], out
    assert not re.search(r"File \"\S*(megadyn|pretrain_gpt)", out), out  # no frame of ours
    root_cause = out.split("Root Cause")[1]
    assert f"traceback : {said[0]}" in root_cause and "exitcode  : 2" in root_cause, out
    print(f"\n{len(out.splitlines())} lines under torchrun:\n{out}")

    code, debug_out = torchrun([*TINY, "--data-path", truncated_corpus], MEGADYN_DEBUG="1")
    assert code != 0 and said[0] in debug_out, debug_out
    assert "megadyn/data/indexed_dataset.py" in debug_out and "IndexedDatasetError" in debug_out
    # the waiting rank's traceback too, unless torchrun stopped it before its wait failed
    assert "Connection closed by peer" in debug_out or "closing signal SIGTERM" in debug_out


# --- the kinds of errors -------------------------------------------------------------------------
def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001
        return e


def test_a_user_error_is_its_own_message():
    kind, text = errors.describe(raised(ConfigError("--foo: unrecognized argument")))
    assert (kind, text) == ("user", "pretrain_gpt.py: error: --foo: unrecognized argument")
    kind, text = errors.describe(raised(ValueError("--split leaves no training data")))
    assert kind == "user", text
    kind, _ = errors.describe(raised(FileNotFoundError("/data/x.idx: no such file")))
    assert kind == "user"


def test_an_unexpected_error_says_where_and_how_to_see_the_traceback():
    kind, text = errors.describe(raised(ZeroDivisionError("division by zero")))
    assert kind == "internal"
    assert re.fullmatch(
        r"pretrain_gpt\.py: error: ZeroDivisionError: division by zero \(at test_errors\.py:\d+ "
        r"in raised\); MEGADYN_DEBUG=1 prints the traceback",
        text,
    ), text


def test_a_lost_peer_is_not_this_ranks_error():
    assert errors.describe(raised(RuntimeError(GLOO_PEER_LOST)))[0] == "peer"
    assert errors.describe(raised(dist.DistBackendError("NCCL error: unhandled")))[0] == "peer"
    wrapped = raised(ConfigError("--load x: reading failed"))  # raised while handling it
    wrapped.__context__ = RuntimeError(GLOO_PEER_LOST)
    assert errors.describe(wrapped)[0] == "peer"


def test_a_checkpoint_exception_reports_the_rank_that_failed():
    """DCP hands every rank the failures of all: each reports the first real one, the same
    text on every rank (so it is printed once)."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    failures = {
        0: _wrap_exception(raised(RuntimeError(GLOO_PEER_LOST))),
        1: _wrap_exception(raised(NotADirectoryError(20, "Not a directory", "/shm/snap1"))),
    }
    kind, text = errors.describe(raised(CheckpointException("save failed", failures)))
    assert kind == "user" and "Traceback" not in text, text
    assert text == "pretrain_gpt.py: error: rank 1: [Errno 20] Not a directory: '/shm/snap1'"
    quoted = raised(ConfigError(f"--load x: failed: {CheckpointException('f', failures)}"))
    assert "\n" not in errors.describe(quoted)[1]


# --- the ranks agree through the agent's store ---------------------------------------------------
def test_one_rank_prints_and_the_others_stay_quiet(tmp_path, monkeypatch, capsys):
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("GROUP_RANK", "0")
    monkeypatch.delenv(errors.DEBUG_ENV, raising=False)
    monkeypatch.setattr(errors, "PEER_GRACE_S", 0.0)

    def report(rank, exc):
        error_file = tmp_path / f"{rank}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        code = errors.report(raised(exc), rank=rank)
        summary = json.loads(error_file.read_text())["message"]["message"]  # torchrun shows it
        return code, capsys.readouterr().err, summary

    msg = "pretrain_gpt.py: error: --global-batch-size 3: not a multiple of 2"
    first = report(1, ConfigError("--global-batch-size 3: not a multiple of 2"))
    assert first == (errors.USER_ERROR_EXIT, msg + "\n", msg)
    same = report(0, ConfigError("--global-batch-size 3: not a multiple of 2"))
    assert same == (errors.USER_ERROR_EXIT, "", msg)  # every rank met it: printed once
    waiting = report(2, RuntimeError(GLOO_PEER_LOST))
    stopped = "stopped because rank 1 failed (its message is printed above)"
    assert waiting == (errors.PEER_FAILED_EXIT, "", stopped)
    other = report(3, OSError("/ckpt/iter_0000006: Permission denied"))
    assert other[1] == "pretrain_gpt.py: error: /ckpt/iter_0000006: Permission denied\n"

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a kill -9 leaves no message:
    lost = [report(r, RuntimeError(GLOO_PEER_LOST)) for r in (0, 1)]  # one line for the job
    assert [code for code, _, _ in lost] == [errors.PEER_FAILED_EXIT] * 2
    assert [err for _, err, _ in lost] == [errors.PEER_LOST_LINE + "\n", ""]
