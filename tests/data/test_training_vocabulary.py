"""Data whose token ids do not fit the tokenizer's vocabulary is refused by pretrain_gpt.py before
the first step, naming the .bin, its largest id, the vocabulary and the flag (once an
"index out of range in self" deep in the embedding); each .bin is scanned once and its range
cached beside it. --vocab-size beside a tokenizer with its own vocabulary is ignored, as in
Megatron-LM, and one line says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from data_helpers import make_indexed

from megadyn.data import token_range as token_range_module
from megadyn.data.indexed_dataset import IndexedDatasetWriter
from megadyn.data.token_range import sidecar_path, token_range
from megadyn.testing import free_port
from tests.tiny import tiny_args

REPO = Path(__file__).resolve().parents[2]
TINY = tiny_args(
    num_layers=1,
    hidden_size=16,
    num_attention_heads=2,
    mock_data=None,  # each test names its data and tokenizer
    tokenizer_type=None,
    vocab_size=None,
    global_batch_size=1,
    train_iters=2,
    eval_interval=0,
    num_workers=0,
)


def pretrain(*flags: str) -> tuple[int, str]:
    """`python pretrain_gpt.py` on one process, as a user runs it: (exit status, output)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    done = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *TINY, *flags],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def error_line(out: str) -> str:
    said = [line for line in out.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(said) == 1, out
    return said[0]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict:
    """Prefixes: `small` (ids below 1000) and `large` (tokenized for 8192 tokens: up to 8191)."""
    directory = tmp_path_factory.mktemp("vocab")
    small = str(directory / "small")
    small_max = int(max(doc.max() for doc in make_indexed(small, [100] * 8, vocab=1000)))
    large = str(directory / "large")
    with IndexedDatasetWriter(large, np.uint16) as writer:
        for _ in range(8):  # id 8191 in every sample
            writer.add_document([8191 if i % 8 == 0 else i for i in range(5, 105)])
    return {"small": small, "large": large, "small_max": small_max}


def test_token_ids_beyond_the_vocabulary_are_named_before_the_first_step(corpora):
    small, large = corpora["small"], corpora["large"]
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
    code, out = pretrain(*null, "--data-path", "0.5", small, "0.5", large)  # a blend: each file
    line = error_line(out)
    assert code == 2 and "index out of range" not in out, out
    assert line == (
        f"pretrain_gpt.py: error: --data-path {large}.bin: token id 8191 is beyond the "
        "vocabulary of 1001 tokens of --tokenizer-type NullTokenizer (--vocab-size); the data "
        "was tokenized with a larger vocabulary: give --vocab-size 8191 or more, or tokenize it "
        "again with tools/preprocess_data.py"
    ), line
    assert json.loads(Path(sidecar_path(small)).read_text())["range"][1] == corpora["small_max"]

    # the next start reads the cached range: the .bin is not scanned again
    cache = Path(sidecar_path(large))
    record = json.loads(cache.read_text())
    assert record["range"] == [0, 8191] and record["size"] == os.path.getsize(large + ".bin")
    cache.write_text(json.dumps({**record, "range": [0, 7000]}))
    code, out = pretrain(*null, "--data-path", large)
    assert code == 2 and "token id 7000 is beyond" in error_line(out), out


def test_vocab_size_beside_a_tokenizer_with_its_own_vocabulary_is_ignored(corpora, gpt2_files):
    """As Megatron-LM, the tokenizer's vocabulary wins (here 270 tokens, not --vocab-size's
    9000, which would have let the ids of `large` through) and one line says so."""
    vocab, merges = gpt2_files
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab]
    code, out = pretrain(*tokenizer, "--merge-file", merges, "--vocab-size", "9000",
                         "--data-path", corpora["large"])  # fmt: skip
    assert (
        " megadyn: --vocab-size 9000 is ignored: --tokenizer-type GPT2BPETokenizer has its own "
        "vocabulary, which the model uses (as in Megatron-LM, only NullTokenizer takes "
        "--vocab-size)"
    ) in out.splitlines(), out
    line = error_line(out)
    assert code == 2 and "vocabulary of 270 tokens of --tokenizer-type GPT2BPETokenizer" in line
    assert "(--vocab-file); " in line and "give the --vocab-file the data was tok" in line, line


def test_a_rewritten_bin_is_scanned_again_and_a_read_only_directory_is_not_cached(
    tmp_path, monkeypatch
):
    prefix = str(tmp_path / "corpus")
    first = np.concatenate(make_indexed(prefix, [50] * 4, vocab=300))
    assert token_range(prefix) == (first.min(), first.max())
    again = np.concatenate(make_indexed(prefix, [50] * 5, vocab=40))  # the cache is stale
    assert token_range(prefix) == (again.min(), again.max()) and again.max() < 40

    def read_only(path, data):
        raise PermissionError(13, "Permission denied", path)

    signed = str(tmp_path / "signed")
    with IndexedDatasetWriter(signed, np.int32) as writer:
        writer.add_document([4, -1, 70000])
    assert token_range(signed) == (-1, 70000)  # a negative id is caught as well

    os.remove(sidecar_path(prefix))
    monkeypatch.setattr(token_range_module, "write_bytes_atomic", read_only)
    assert token_range(prefix) == (again.min(), again.max())
    assert not os.path.exists(sidecar_path(prefix))
