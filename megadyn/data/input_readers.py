"""Read preprocessing input in chunks: jsonl lines, parquet rows or `datasets` rows.

Each chunk is a list of items `(number, offset, payload)`: the 1-based line (jsonl) or row
number, the line's byte offset in the file (jsonl only), and the raw line bytes (decoded and
parsed later, in the worker processes) or the row as a dict. Chunks come in input order.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

CHUNK_BYTES = 1 << 18
CHUNK_ITEMS = 256

Item = tuple[int, int, Any]  # (line or row number, byte offset in the file, raw line or record)


class PreprocessError(ValueError):
    """Bad input; the message names the file and the line (or row)."""


def _jsonl_chunks(path: str) -> Iterator[tuple[list[Item], int]]:
    chunk, size, offset = [], 0, 0
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                chunk.append((line_no, offset, line))
            size += len(line)
            offset += len(line)
            if size >= CHUNK_BYTES or len(chunk) >= CHUNK_ITEMS:
                yield chunk, size
                chunk, size = [], 0
    if chunk or size:
        yield chunk, size


def _record_chunks(columns: dict[str, list], start_row: int) -> list[Item]:
    rows = len(next(iter(columns.values())))
    return [(start_row + i + 1, 0, {k: v[i] for k, v in columns.items()}) for i in range(rows)]


def _parquet_chunks(path: str, keys: Sequence[str]) -> Iterator[tuple[list[Item], int]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    names = parquet.schema_arrow.names
    for key in keys:
        if key not in names:
            raise PreprocessError(f"{path}: no column {key!r} (columns: {', '.join(names)})")
    row = 0
    for batch in parquet.iter_batches(batch_size=CHUNK_ITEMS, columns=list(keys)):
        columns = {k: batch.column(k).to_pylist() for k in keys}
        yield _record_chunks(columns, row), batch.nbytes
        row += batch.num_rows


def _hf_chunks(path: str, keys: Sequence[str]) -> Iterator[tuple[list[Item], int]]:
    import datasets

    dataset = datasets.load_from_disk(path)
    if isinstance(dataset, datasets.DatasetDict):
        splits = list(dataset)
        if "train" not in dataset and len(splits) != 1:
            raise PreprocessError(f"{path}: several splits ({', '.join(splits)}) and no 'train'")
        dataset = dataset["train" if "train" in dataset else splits[0]]
    for key in keys:
        if key not in dataset.column_names:
            names = ", ".join(dataset.column_names)
            raise PreprocessError(f"{path}: no column {key!r} (columns: {names})")
    dataset = dataset.select_columns(list(keys))
    for start in range(0, len(dataset), CHUNK_ITEMS):
        columns = dataset[start : start + CHUNK_ITEMS]
        size = sum(len(t) for k in keys for t in columns[k] if isinstance(t, str))
        yield _record_chunks(columns, start), size


def iter_input_chunks(path: str, keys: Sequence[str]) -> Iterator[tuple[list[Item], int]]:
    """Chunks of (number, offset, line-or-record) items and their input byte count."""
    if os.path.isdir(path):
        return _hf_chunks(path, keys)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--input {path}: no such file or directory")
    if path.endswith(".parquet"):
        return _parquet_chunks(path, keys)
    return _jsonl_chunks(path)
