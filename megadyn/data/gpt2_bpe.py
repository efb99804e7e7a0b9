"""GPT-2's byte-level BPE in pure Python, read from a `vocab.json` and a `merges.txt`.

Text is split with GPT-2's pre-tokenization pattern, each piece's UTF-8 bytes are mapped to
printable characters (GPT-2's byte-to-unicode table), and merges are applied by rank. The ids
match those of GPT-2's reference encoder (and Hugging Face's byte-level BPE) for the same files.

    bpe = ByteLevelBPE.from_files("vocab.json", "merges.txt")
    ids = bpe.encode("Hello world")
    assert bpe.decode(ids) == "Hello world"
"""

from __future__ import annotations

import json
from functools import lru_cache

try:
    import regex as _re

    _PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
except ImportError:  # stdlib `re` has no \p{..}; this is the same split for nearly all text
    import re as _re

    _PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""


_NO_MERGE = 1 << 62


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


class ByteLevelBPE:
    """Byte-level BPE encoder/decoder over a token->id vocabulary and ranked merges."""

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
        self.encoder = vocab
        self.decoder = {i: t for t, i in vocab.items()}
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.pattern = _re.compile(_PATTERN)
        self._cache: dict[str, list[str]] = {}

    @classmethod
    def from_files(cls, vocab_file: str, merge_file: str) -> ByteLevelBPE:
        """Read GPT-2's `vocab.json` and `merges.txt` (its `#version` line is skipped)."""
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
        merges = []
        with open(merge_file, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                line = line.rstrip("\n")
                if not line or (line_no == 1 and line.startswith("#version")):
                    continue
                parts = line.split(" ")
                if len(parts) != 2:
                    raise ValueError(f"{merge_file}:{line_no}: expected two tokens, got {line!r}")
                merges.append((parts[0], parts[1]))
        return cls(vocab, merges)

    def _bpe(self, word: str) -> list[str]:
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        parts = list(word)
        while len(parts) > 1:
            best = min(zip(parts, parts[1:]), key=lambda pair: self.ranks.get(pair, _NO_MERGE))
            if best not in self.ranks:
                break
            first, second = best
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == first and parts[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        if len(self._cache) < 100_000:
            self._cache[word] = parts
        return parts

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""
        ids = []
        for piece in self.pattern.findall(text):
            word = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            for token in self._bpe(word):
                try:
                    ids.append(self.encoder[token])
                except KeyError:
                    raise ValueError(f"BPE token {token!r} is not in the vocabulary") from None
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (invalid UTF-8 byte runs become U+FFFD)."""
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")
