"""Preprocessing: outputs named as Megatron names them, any worker count, bad input, CLI."""

from __future__ import annotations

import os
import re
import runpy
import sys

import numpy as np
import pytest
from data_helpers import listdir, write_jsonl

from megadyn.data.indexed_dataset import IndexedDataset
from megadyn.data.preprocess import PreprocessError, preprocess_data
from megadyn.data.tokenizers import build_tokenizer

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")


def _run(input_path, out_prefix, sp_model, **kwargs):
    return preprocess_data(
        str(input_path),
        str(out_prefix),
        "GPTSentencePieceTokenizer",
        tokenizer_model=sp_model,
        **kwargs,
    )


def test_jsonl_to_indexed_dataset(tmp_path, corpus_jsonl, sp_model):
    result = _run(
        corpus_jsonl, tmp_path / "out" / "c", sp_model, json_keys=["text", "title"], append_eod=True
    )
    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp_model)
    assert result.output_prefixes == {
        "text": str(tmp_path / "out" / "c_text_document"),
        "title": str(tmp_path / "out" / "c_title_document"),
    }
    assert result.documents == {"text": 59, "title": 60}
    assert result.empty_documents == {"text": 1, "title": 0}
    dataset = IndexedDataset(result.output_prefixes["text"])
    assert dataset.dtype == np.uint16 and len(dataset) == 59
    first = dataset[0].tolist()
    assert first[-1] == tokenizer.eod
    assert tokenizer.detokenize(first[:-1]).startswith("Document 0. The quick brown fox")
    assert int(dataset.sequence_lengths.sum()) == result.tokens["text"]


def test_two_workers_equal_one_worker_byte_for_byte(tmp_path, corpus_jsonl, sp_model, monkeypatch):
    monkeypatch.setattr("megadyn.data.input_readers.CHUNK_ITEMS", 7)  # many chunks, reordered
    one = _run(corpus_jsonl, tmp_path / "one", sp_model, append_eod=True, workers=1)
    two = _run(corpus_jsonl, tmp_path / "two", sp_model, append_eod=True, workers=2)
    for suffix in (".bin", ".idx"):
        a = open(one.output_prefixes["text"] + suffix, "rb").read()
        assert a == open(two.output_prefixes["text"] + suffix, "rb").read()


@pytest.mark.parametrize(
    "lines, message",
    [
        ([b'{"text": "ok"}', b'{"text": "bad \xff byte"}'], r":2: invalid UTF-8 at byte offset 29"),
        ([b'{"text": "ok"}', b"", b'{"body": "x"}'], r":3: missing key 'text' \(--json-keys\)"),
        ([b'{"text": "ok"}', b'{"text": '], r":2: invalid JSON"),
        ([b'{"text": 5}'], r":1: key 'text' holds int, not text"),
    ],
)
@pytest.mark.parametrize("workers", [1, 2])
def test_bad_input_names_file_and_line_and_leaves_nothing(
    tmp_path, sp_model, lines, message, workers
):
    source = tmp_path / "in" / "bad.jsonl"
    source.parent.mkdir()
    source.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(PreprocessError, match=re.escape(str(source)) + message):
        _run(source, out / "x", sp_model, workers=workers)
    assert listdir(out) == []


def test_parquet_and_datasets_directory_inputs(tmp_path, sp_model):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    texts = ["first document", "", "second one", "third"]
    pq.write_table(pa.table({"text": texts}), str(tmp_path / "in.parquet"))
    from_parquet = _run(tmp_path / "in.parquet", tmp_path / "pq", sp_model)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "hf"))
    from_hf = _run(tmp_path / "hf", tmp_path / "hf_out", sp_model)
    write_jsonl(str(tmp_path / "in.jsonl"), [{"text": t} for t in texts])
    from_jsonl = _run(tmp_path / "in.jsonl", tmp_path / "js", sp_model)
    expected = open(from_jsonl.output_prefixes["text"] + ".bin", "rb").read()
    for result in (from_parquet, from_hf):
        assert result.documents["text"] == 3 and result.empty_documents["text"] == 1
        assert open(result.output_prefixes["text"] + ".bin", "rb").read() == expected
    with pytest.raises(PreprocessError, match=r"in.parquet: no column 'body'"):
        _run(tmp_path / "in.parquet", tmp_path / "pq2", sp_model, json_keys=["body"])
    assert not os.path.exists(tmp_path / "pq2_body_document.bin")


def test_cli(tmp_path, corpus_jsonl, gpt2_files, monkeypatch, capsys):
    vocab_file, merge_file = gpt2_files
    argv = ["preprocess_data.py", "--input", corpus_jsonl, "--output-prefix", str(tmp_path / "g")]
    argv += ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file]
    argv += ["--merge-file", merge_file, "--append-eod", "--workers", "2", "--no-progress"]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(os.path.join(TOOLS, "preprocess_data.py"), run_name="__main__")
    assert "59 documents" in capsys.readouterr().out
    dataset = IndexedDataset(str(tmp_path / "g_text_document"))
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    assert tokenizer.detokenize(dataset[0][:-1].tolist()).startswith("Document 0. The quick")


def test_train_tokenizer_cli(tmp_path, corpus_jsonl, monkeypatch):
    prefix = str(tmp_path / "spm")
    argv = ["train_tokenizer.py", "--input", corpus_jsonl, "--model-prefix", prefix]
    monkeypatch.setattr(sys, "argv", argv + ["--vocab-size", "400"])
    runpy.run_path(os.path.join(TOOLS, "train_tokenizer.py"), run_name="__main__")
    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=prefix + ".model")
    assert tokenizer.detokenize(tokenizer.tokenize("Document 5. café")) == "Document 5. café"


@pytest.mark.parametrize("lines", [[], [b""], [b'{"text": ""}', b'{"text": ""}']])
def test_input_without_documents_fails_and_writes_nothing(tmp_path, sp_model, lines, monkeypatch):
    source = tmp_path / "empty.jsonl"
    source.write_bytes(b"".join(line + b"\n" for line in lines))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(PreprocessError, match=re.escape(str(source)) + r": no documents"):
        _run(source, out / "x", sp_model)
    assert listdir(out) == []
    argv = ["preprocess_data.py", "--input", str(source), "--output-prefix", str(out / "x")]
    argv += ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model]
    monkeypatch.setattr(sys, "argv", argv + ["--no-progress"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(os.path.join(TOOLS, "preprocess_data.py"), run_name="__main__")
    assert exit_info.value.code != 0 and str(source) in str(exit_info.value.code)
    assert listdir(out) == []
