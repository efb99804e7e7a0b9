"""Tokenize a corpus into Megatron indexed datasets (the logic of tools/preprocess_data.py).

Input is jsonl (one JSON object per line), a parquet file, or a Hugging Face `datasets`
directory written by `save_to_disk` (read offline with `load_from_disk`). For each of
`json_keys` the output is `{output_prefix}_{key}_document.bin/.idx`, named as Megatron-LM names
them, with one sequence per document and the token dtype Megatron picks for the vocabulary.

- Documents that tokenize to nothing are skipped and counted (Megatron would write empty ones).
- An input that gives a key no document at all (an empty file, only empty texts) is an error,
  as the bad inputs below are: a dataset without documents cannot be trained on.
- Invalid UTF-8, invalid JSON, a missing key or a non-string value stops the run with an error
  naming the file and line (or row); nothing is left under the output names (all outputs are
  written to temporary names and renamed at the end).
- `workers > 1` tokenizes chunks in that many processes; chunks are written back in input
  order, so the output is byte-identical for any number of workers.

    result = preprocess_data("corpus.jsonl", "data/corpus", "GPTSentencePieceTokenizer",
                             tokenizer_model="spm.model", append_eod=True, workers=2)
    result.output_prefixes["text"]  # "data/corpus_text_document"
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megadyn.data.indexed_dataset import IndexedDatasetWriter, optimal_dtype
from megadyn.data.input_readers import Item, PreprocessError, iter_input_chunks
from megadyn.data.tokenizers import build_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class PreprocessResult:
    """What a preprocessing run wrote, per JSON key."""

    output_prefixes: dict[str, str]
    documents: dict[str, int]
    empty_documents: dict[str, int]
    tokens: dict[str, int]
    input_bytes: int = 0
    input_records: int = 0
    seconds: float = 0.0


def document_prefix(output_prefix: str, key: str) -> str:
    """Megatron's name for the dataset of one JSON key: `{prefix}_{key}_document`."""
    return f"{output_prefix}_{key}_document"


# ---- tokenizing: runs in the worker processes (or in-process for one worker) --------------

_WORKER: dict[str, Any] = {}  # per-process state of the pool initializer


def _init_worker(path: str, spec: dict, keys: Sequence[str], append_eod: bool, dtype) -> None:
    tokenizer = build_tokenizer(**spec)
    eod = tokenizer.eod if append_eod else None
    _WORKER.update(path=path, tokenizer=tokenizer, keys=keys, eod=eod, dtype=np.dtype(dtype))


def _parse(path: str, number: int, offset: int, payload: Any) -> dict:
    if not isinstance(payload, bytes):
        return payload
    try:
        line = payload.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PreprocessError(
            f"{path}:{number}: invalid UTF-8 at byte offset {offset + e.start} ({e.reason})"
        ) from None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise PreprocessError(
            f"{path}:{number}: invalid JSON: {e.msg} at column {e.colno}"
        ) from None
    if not isinstance(record, dict):
        raise PreprocessError(
            f"{path}:{number}: expected a JSON object, got {type(record).__name__}"
        )
    return record


def _encode_chunk(items: list[Item]) -> dict[str, tuple[bytes, list[int], int]]:
    """Per key: the chunk's token bytes, its document lengths, and its count of empty docs."""
    path, tokenizer, eod, dtype = (_WORKER[k] for k in ("path", "tokenizer", "eod", "dtype"))
    keys = _WORKER["keys"]
    docs = {key: [] for key in keys}
    empty = dict.fromkeys(keys, 0)
    for number, offset, payload in items:
        record = _parse(path, number, offset, payload)
        where = f"{path}:{number}" if isinstance(payload, bytes) else f"{path}: row {number}"
        for key in keys:
            text = record.get(key)
            if text is None:
                raise PreprocessError(f"{where}: missing key {key!r} (--json-keys)")
            if not isinstance(text, str):
                raise PreprocessError(f"{where}: key {key!r} holds {type(text).__name__}, not text")
            ids = tokenizer.tokenize(text)
            if not ids:
                empty[key] += 1
                continue
            if eod is not None:
                ids.append(eod)
            docs[key].append(np.asarray(ids, dtype=dtype))
    return {
        key: (np.concatenate(d).tobytes() if d else b"", [len(x) for x in d], empty[key])
        for key, d in docs.items()
    }


@contextlib.contextmanager
def _encoder_map(workers: int, init_args: tuple) -> Iterator[Callable]:
    """Yield `map(_encode_chunk, chunks)` in input order, over a bounded window of pool tasks.

    The pool is started here, before any progress-bar thread, so forking stays safe.
    """
    if workers <= 1:
        _init_worker(*init_args)
        yield lambda chunks: map(_encode_chunk, chunks)
        return
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=init_args) as pool:

        def pool_map(chunks):
            window: collections.deque = collections.deque()
            for chunk in chunks:
                window.append(pool.apply_async(_encode_chunk, (chunk,)))
                if len(window) >= 4 * workers:
                    yield window.popleft().get()
            while window:
                yield window.popleft().get()

        yield pool_map


def preprocess_data(
    input_path: str,
    output_prefix: str,
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    vocab_size: int | None = None,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    log_interval: int = 1000,
    progress: bool = False,
) -> PreprocessResult:
    """Tokenize `input_path` into `{output_prefix}_{key}_document.bin/.idx` for each key."""
    spec = dict(
        tokenizer_type=tokenizer_type,
        tokenizer_model=tokenizer_model,
        vocab_file=vocab_file,
        merge_file=merge_file,
        vocab_size=vocab_size,
    )
    keys = list(json_keys)
    dtype = optimal_dtype(build_tokenizer(**spec).vocab_size)
    chunks = iter_input_chunks(input_path, keys)
    prefixes = {k: document_prefix(output_prefix, k) for k in keys}
    result = PreprocessResult(
        prefixes, dict.fromkeys(keys, 0), dict.fromkeys(keys, 0), dict.fromkeys(keys, 0)
    )
    writers: dict[str, IndexedDatasetWriter] = {}
    init_args = (input_path, spec, keys, append_eod, dtype)
    start = time.perf_counter()
    try:
        writers.update((k, IndexedDatasetWriter(p, dtype)) for k, p in prefixes.items())
        sized = _SizedChunks(chunks)
        with (
            _encoder_map(workers, init_args) as encode_all,
            _Progress(input_path, progress, log_interval, start) as bar,
        ):
            for encoded in encode_all(sized):
                for key, (tokens, lengths, empty) in encoded.items():
                    writers[key].add_raw(tokens, lengths)
                    result.documents[key] += len(lengths)
                    result.empty_documents[key] += empty
                    result.tokens[key] += sum(lengths)
                records, size = sized.done()
                result.input_records += records
                result.input_bytes += size
                bar.update(size, result.input_records)
        _check_some_documents(input_path, result)
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    for writer in writers.values():
        writer.finalize()
    result.seconds = time.perf_counter() - start
    for key in keys:
        if result.empty_documents[key]:
            logger.warning(
                "%s: skipped %d empty documents", prefixes[key], result.empty_documents[key]
            )
    return result


def _check_some_documents(input_path: str, result: PreprocessResult) -> None:
    """Refuse an input that gives a key no document: training could not use its dataset."""
    for key, count in result.documents.items():
        if count == 0:
            raise PreprocessError(
                f"{input_path}: no documents for key {key!r} ({result.input_records} records, "
                f"{result.empty_documents[key]} of them empty after tokenizing); nothing written"
            )


class _SizedChunks:
    """Iterates chunk items; remembers their sizes so results can be counted in order."""

    def __init__(self, chunks: Iterator[tuple[list[Item], int]]) -> None:
        self.chunks, self.sizes = chunks, collections.deque()

    def __iter__(self) -> Iterator[list[Item]]:
        for items, size in self.chunks:
            self.sizes.append((len(items), size))
            yield items

    def done(self) -> tuple[int, int]:
        return self.sizes.popleft()


class _Progress:
    """A tqdm bar over input bytes (or a log line every `log_interval` documents)."""

    def __init__(self, path: str, enabled: bool, log_interval: int, start: float) -> None:
        self.log_interval, self.start = max(1, log_interval), start
        self.bytes, self.next_log, self.bar = 0, self.log_interval, None
        if enabled:
            from tqdm import tqdm

            total = (
                os.path.getsize(path)
                if os.path.isfile(path) and not path.endswith(".parquet")
                else None
            )
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=os.path.basename(path))

    def update(self, size: int, total_records: int) -> None:
        self.bytes += size
        if self.bar is not None:
            self.bar.update(size)
        if total_records >= self.next_log:
            self.next_log = (total_records // self.log_interval + 1) * self.log_interval
            elapsed = max(time.perf_counter() - self.start, 1e-9)
            rate = f"{total_records / elapsed:.0f} docs/s, {self.bytes / elapsed / 2**20:.2f} MB/s"
            if self.bar is not None:
                self.bar.set_postfix_str(f"{total_records} docs, {rate}")
            else:
                logger.info("processed %d documents (%s)", total_records, rate)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
