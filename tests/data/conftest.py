"""Fixtures of the data tests: tiny tokenizer files built here, and small corpora."""

from __future__ import annotations

import json

import pytest
from data_helpers import SENTENCES, write_jsonl

from megadyn.data.gpt2_bpe import bytes_to_unicode
from megadyn.data.sp_train import train_sentencepiece


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory) -> str:
    """A tiny byte-fallback SentencePiece model trained on SENTENCES."""
    directory = tmp_path_factory.mktemp("spm")
    corpus = write_jsonl(str(directory / "corpus.jsonl"), [{"text": s} for s in SENTENCES * 20])
    return train_sentencepiece([corpus], str(directory / "tiny"), vocab_size=400)


@pytest.fixture(scope="session")
def gpt2_files(tmp_path_factory) -> tuple[str, str]:
    """A GPT-2-style vocab.json / merges.txt: the 256 byte symbols plus a few merges."""
    directory = tmp_path_factory.mktemp("gpt2")
    symbols = list(bytes_to_unicode().values())
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("o", "n"), ("e", "r")]
    merges += [("in", "g"), ("Ġ", "d"), ("a", "t"), ("Ġd", "at"), ("Ġdat", "a"), ("t", "h")]
    vocab = {s: i for i, s in enumerate(symbols)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    vocab_file, merge_file = directory / "vocab.json", directory / "merges.txt"
    vocab_file.write_text(json.dumps(vocab), encoding="utf-8")
    merge_file.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), "utf-8")
    return str(vocab_file), str(merge_file)


@pytest.fixture
def corpus_jsonl(tmp_path) -> str:
    """A jsonl of 60 varied documents (one empty), keys `text` and `title`."""
    records = []
    for i in range(60):
        body = " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(1 + i % 5))
        records.append({"text": "" if i == 7 else f"Document {i}. {body}", "title": f"Title {i}"})
    return write_jsonl(str(tmp_path / "corpus.jsonl"), records)
