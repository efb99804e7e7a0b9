"""The .bin/.idx format: a pair built by hand from the published layout, all dtypes, bad files."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from data_helpers import listdir, make_indexed

from megadyn.data.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
)

DOCS = [[5, 6, 7], [1], [9, 9, 9, 9, 2], [3, 4]]


def handmade_pair(prefix: str, docs: list[list[int]], dtype, code: int) -> None:
    """Megatron's layout written out field by field, without our writer."""
    lengths = [len(d) for d in docs]
    itemsize = np.dtype(dtype).itemsize
    pointers = [sum(lengths[:i]) * itemsize for i in range(len(docs))]
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    idx += struct.pack("<Q", len(docs)) + struct.pack("<Q", len(docs) + 1)
    idx += struct.pack(f"<{len(docs)}i", *lengths)
    idx += struct.pack(f"<{len(docs)}q", *pointers)
    idx += struct.pack(f"<{len(docs) + 1}q", *range(len(docs) + 1))
    with open(prefix + ".idx", "wb") as f:
        f.write(idx)
    with open(prefix + ".bin", "wb") as f:
        f.write(np.concatenate([np.asarray(d, dtype) for d in docs]).tobytes())


def test_handmade_pair_loads_and_ours_is_byte_identical(tmp_path):
    hand, ours = str(tmp_path / "hand"), str(tmp_path / "ours")
    handmade_pair(hand, DOCS, np.uint16, 8)
    dataset = IndexedDataset(hand)
    assert len(dataset) == dataset.num_documents == 4
    assert dataset.dtype == np.uint16
    assert [dataset[i].tolist() for i in range(4)] == DOCS
    assert dataset.get(2, offset=1, length=3).tolist() == [9, 9, 9]
    with IndexedDatasetWriter(ours, np.uint16) as writer:
        for doc in DOCS:
            writer.add_document(doc)
    for suffix in (".idx", ".bin"):
        assert open(ours + suffix, "rb").read() == open(hand + suffix, "rb").read()


def test_megatron_item_api_and_multi_sequence_documents(tmp_path):
    prefix = str(tmp_path / "seq")
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        writer.add_item([1, 2])
        writer.add_item([3])
        writer.end_document()
        writer.add_document([4, 5, 6], lengths=[1, 2])
    dataset = IndexedDataset(prefix)
    assert dataset.document_indices.tolist() == [0, 2, 4]
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[1, 2], [3], [4], [5, 6]]


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_round_trip_of_every_dtype(tmp_path, code):
    dtype = np.dtype(DTYPE_CODES[code])
    rng = np.random.default_rng(code)
    docs = [rng.integers(0, 100, n).astype(dtype) for n in (0, 3, 17, 1)]
    prefix = str(tmp_path / f"d{code}")
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
    assert open(prefix + ".idx", "rb").read()[17] == code
    dataset = IndexedDataset(prefix)
    assert dataset.dtype == dtype
    for got, want in zip((dataset[i] for i in range(len(dataset))), docs):
        assert got.dtype == dtype and np.array_equal(got, want)


def test_writer_leaves_nothing_on_error(tmp_path):
    with pytest.raises(RuntimeError), IndexedDatasetWriter(str(tmp_path / "x"), np.uint16) as w:
        w.add_document([1, 2, 3])
        raise RuntimeError("boom")
    assert listdir(tmp_path) == []


def _corrupt(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_bad_files_name_the_file_and_offset(tmp_path):
    prefix = str(tmp_path / "good")
    make_indexed(prefix, [10, 20, 30])
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    original_idx, original_bin = open(idx, "rb").read(), open(bin_, "rb").read()

    def expect(match: str) -> None:
        with pytest.raises(IndexedDatasetError, match=match):
            IndexedDataset(prefix)
        open(idx, "wb").write(original_idx)
        open(bin_, "wb").write(original_bin)

    _corrupt(idx, 0, b"XXIDIDX")
    expect(rf"{re.escape(idx)}: not a Megatron index: bytes 0-8")
    _corrupt(idx, 9, struct.pack("<Q", 2))
    expect(rf"{re.escape(idx)}: unsupported index version 2 at offset 9")
    _corrupt(idx, 17, b"\x09")
    expect(rf"{re.escape(idx)}: unknown dtype code 9 at offset 17")
    open(idx, "wb").write(original_idx[:20])
    expect(rf"{re.escape(idx)}: truncated index: the header needs 34 bytes, file has 20")
    open(idx, "wb").write(original_idx[:-5])
    expect(rf"{re.escape(idx)}: truncated index: .* file ends at offset {len(original_idx) - 5}")
    open(bin_, "wb").write(original_bin[:50])
    expect(
        rf"{re.escape(bin_)}: truncated token file: sequence 1 spans bytes \[20, 60\) .* offset 50"
    )
    open(bin_, "wb").write(original_bin + b"\0\0")
    expect(rf"{re.escape(bin_)}: 2 unexpected bytes after offset 120")
    IndexedDataset(prefix)  # restored


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.idx"):
        IndexedDataset(str(tmp_path / "nothing"))
