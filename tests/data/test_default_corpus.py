"""The default corpus builds from the standard library's documentation, once."""

from __future__ import annotations

import os

from megadyn.data.default_corpus import prepare_default_data
from megadyn.data.indexed_dataset import IndexedDataset
from megadyn.data.tokenizers import build_tokenizer


def test_default_corpus_builds_and_is_reused(tmp_path):
    paths = prepare_default_data(str(tmp_path), vocab_size=4096)
    dataset = IndexedDataset(paths["data_prefix"])
    tokenizer = build_tokenizer(paths["tokenizer_type"], tokenizer_model=paths["tokenizer_model"])
    assert tokenizer.vocab_size == 4096
    assert dataset.num_documents > 300 and int(dataset.sequence_lengths.sum()) > 300_000
    assert dataset[0][-1] == tokenizer.eod
    assert "the" in tokenizer.detokenize(dataset[0][:200].tolist())
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    stamps = {f: os.stat(tmp_path / f).st_mtime_ns for f in os.listdir(tmp_path)}
    assert prepare_default_data(str(tmp_path), vocab_size=4096) == paths
    assert {f: os.stat(tmp_path / f).st_mtime_ns for f in os.listdir(tmp_path)} == stamps
