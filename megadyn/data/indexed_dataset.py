"""Megatron-LM's indexed dataset: a `.bin` file of token ids and an `.idx` file that indexes it.

Files written here are byte-identical to those Megatron-LM's `IndexedDatasetBuilder` writes for
the same tokens, and files it writes load here. The `.idx` layout (all little-endian):

    offset 0   9 bytes   magic b"MMIDIDX\\x00\\x00"
    offset 9   uint64    version, always 1
    offset 17  uint8     dtype code of the tokens in `.bin` (see DTYPE_CODES)
    offset 18  uint64    S, the number of sequences
    offset 26  uint64    D, the number of document indices (documents + 1)
    offset 34  int32[S]  sequence lengths, in tokens
               int64[S]  sequence pointers, byte offsets into `.bin`
               int64[D]  document indices: sequence index where each document starts,
                         starting with 0 and ending with S
               (int8[S]  sequence modes, only in Megatron's multimodal files; ignored here)

Without sentence splitting (our preprocessing never splits) a sequence is a whole document.

    with IndexedDatasetWriter("data/corpus_text_document", np.uint16) as writer:
        writer.add_document([5, 6, 7])
    dataset = IndexedDataset("data/corpus_text_document")
    dataset[0]  # -> array([5, 6, 7], dtype=uint16), a view into the memory-mapped .bin
"""

from __future__ import annotations

import os
import struct
from array import array
from collections.abc import Sequence

import numpy as np

from megadyn.data.atomic_files import atomic_outputs, remove_quietly, temporary_name

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # 34
DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): code for code, t in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A `.bin` / `.idx` pair that cannot be read; the message names the file and offset."""


def idx_path(prefix: str) -> str:
    """Path of the index file of a dataset prefix."""
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    """Path of the token file of a dataset prefix."""
    return prefix + ".bin"


def optimal_dtype(vocab_size: int | None) -> type[np.number]:
    """Megatron's token dtype for a vocabulary: uint16 below 65,500 ids, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def dtype_code(dtype: np.dtype | type) -> int:
    """Megatron's dtype code of `dtype` (ValueError if the format has none)."""
    try:
        return CODE_OF_DTYPE[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {np.dtype(dtype)} has no Megatron code") from None


def encode_index(
    dtype: np.dtype | type, sequence_lengths: Sequence[int], document_indices: Sequence[int]
) -> bytes:
    """The bytes of an `.idx` file (pointers are derived from lengths and the dtype size)."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= np.dtype(dtype).itemsize
    header = INDEX_MAGIC + struct.pack(
        "<QBQQ", INDEX_VERSION, dtype_code(dtype), len(lengths), len(document_indices)
    )
    docs = np.asarray(document_indices, dtype=np.int64)
    return header + lengths.tobytes() + pointers.tobytes() + docs.tobytes()


class IndexedDatasetWriter:
    """Write a `.bin` / `.idx` pair under temporary names; rename both when finalized.

    Used as a context manager it finalizes on success and removes its temporaries on error.
    """

    def __init__(self, prefix: str, dtype: np.dtype | type = np.int32) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # reject dtypes the format cannot name
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._tmp_bin = temporary_name(bin_path(prefix))
        self._bin = open(self._tmp_bin, "wb")
        self.sequence_lengths = array("i")
        self.document_indices = array("q", [0])

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence; close the document with `end_document`."""
        data = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(data.tobytes())
        self.sequence_lengths.append(data.size)

    def end_document(self) -> None:
        """Close the document made of the sequences added since the last one."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(
        self, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int] | None = None
    ) -> None:
        """Append one document, made of sequences of `lengths` (default: one sequence)."""
        data = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(data.tobytes())
        self.sequence_lengths.extend([data.size] if lengths is None else lengths)
        self.end_document()

    def add_raw(self, token_bytes: bytes, lengths: Sequence[int]) -> None:
        """Append documents of one sequence each from tokens already encoded in `dtype`."""
        self._bin.write(token_bytes)
        start = len(self.sequence_lengths)
        self.sequence_lengths.extend(lengths)
        self.document_indices.extend(range(start + 1, start + len(lengths) + 1))

    def finalize(self) -> None:
        """Write the index and rename both files into place."""
        self._bin.close()
        index = encode_index(self.dtype, self.sequence_lengths, self.document_indices)
        try:
            with atomic_outputs([idx_path(self.prefix)]) as (tmp_idx,), open(tmp_idx, "wb") as f:
                f.write(index)
            os.replace(self._tmp_bin, bin_path(self.prefix))
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Drop everything written so far."""
        self._bin.close()
        remove_quietly(self._tmp_bin)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def _read_header(path: str, size: int) -> tuple[np.dtype, int, int]:
    if size < HEADER_BYTES:
        raise IndexedDatasetError(
            f"{path}: truncated index: the header needs {HEADER_BYTES} bytes, file has {size}"
        )
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if head[:9] != INDEX_MAGIC:
        raise IndexedDatasetError(
            f"{path}: not a Megatron index: bytes 0-8 are {head[:9]!r}, expected {INDEX_MAGIC!r}"
        )
    version, code, num_sequences, num_doc_indices = struct.unpack("<QBQQ", head[9:])
    if version != INDEX_VERSION:
        raise IndexedDatasetError(
            f"{path}: unsupported index version {version} at offset 9 (expected 1)"
        )
    if code not in DTYPE_CODES:
        raise IndexedDatasetError(f"{path}: unknown dtype code {code} at offset 17")
    return np.dtype(DTYPE_CODES[code]), num_sequences, num_doc_indices


class IndexedDataset:
    """Memory-mapped reader of a Megatron `.bin` / `.idx` pair at `prefix`.

    `dataset[i]` is sequence i as a read-only numpy view. The file sizes and the index are
    checked when opened, so a truncated or foreign file fails here with the file and offset.
    Pickling keeps only the prefix (so DataLoader workers reopen the maps).
    """

    def __init__(self, prefix: str) -> None:
        self.path_prefix = prefix
        index_file, token_file = idx_path(prefix), bin_path(prefix)
        for path in (index_file, token_file):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file not found: {path}")
        idx_size = os.path.getsize(index_file)
        self.dtype, num_sequences, num_doc_indices = _read_header(index_file, idx_size)
        expected = HEADER_BYTES + 12 * num_sequences + 8 * num_doc_indices
        if idx_size < expected:
            raise IndexedDatasetError(
                f"{index_file}: truncated index: {num_sequences} sequences and "
                f"{num_doc_indices} document indices need {expected} bytes, file ends at "
                f"offset {idx_size}"
            )
        if idx_size not in (expected, expected + num_sequences):  # + int8 modes if multimodal
            raise IndexedDatasetError(
                f"{index_file}: {idx_size - expected} unexpected bytes after offset {expected}"
            )
        self._idx_map = np.memmap(index_file, mode="r", dtype=np.uint8)
        offset = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(self._idx_map, np.int32, num_sequences, offset)
        offset += 4 * num_sequences
        self.sequence_pointers = np.frombuffer(self._idx_map, np.int64, num_sequences, offset)
        offset += 8 * num_sequences
        self.document_indices = np.frombuffer(self._idx_map, np.int64, num_doc_indices, offset)
        self._check_document_indices(index_file, offset)
        self._check_bin(token_file)

    def _check_document_indices(self, path: str, offset: int) -> None:
        docs, count = self.document_indices, len(self.sequence_lengths)
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != count or np.any(np.diff(docs) < 0):
            raise IndexedDatasetError(
                f"{path}: bad document indices at offset {offset}: they must rise from 0 to "
                f"the sequence count {count}"
            )

    def _check_bin(self, path: str) -> None:
        size = os.path.getsize(path)
        itemsize = self.dtype.itemsize
        ends = self.sequence_pointers + self.sequence_lengths.astype(np.int64) * itemsize
        expected = int(ends[-1]) if len(ends) else 0
        if size < expected:
            bad = int(np.argmax(ends > size))
            raise IndexedDatasetError(
                f"{path}: truncated token file: sequence {bad} spans bytes "
                f"[{int(self.sequence_pointers[bad])}, {int(ends[bad])}) but the file ends at "
                f"offset {size}"
            )
        if size != expected:
            raise IndexedDatasetError(
                f"{path}: {size - expected} unexpected bytes after offset {expected}"
            )
        self._bin_map = np.memmap(path, mode="r", dtype=np.uint8) if size else np.empty(0, "u1")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        """Number of documents (one less than the number of document indices)."""
        return len(self.document_indices) - 1

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset : offset + length` of sequence `index` (to its end if no length)."""
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) of a {size}-token sequence")
        start = int(self.sequence_pointers[index]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_map, self.dtype, length, start)

    def __getitem__(self, index: int) -> np.ndarray:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sequence {index} of {len(self)} in {self.path_prefix}")
        return self.get(int(index) % len(self))

    def __getstate__(self) -> str:
        return self.path_prefix

    def __setstate__(self, prefix: str) -> None:
        self.__init__(prefix)

    @staticmethod
    def exists(prefix: str) -> bool:
        """Whether both files of `prefix` exist."""
        return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))
