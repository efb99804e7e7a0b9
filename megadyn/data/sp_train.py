"""Train a SentencePiece model on plain-text or jsonl files (the logic of tools/train_tokenizer.py).

The defaults make a model that round-trips any text exactly, which is what language-model
pre-training wants: BPE, byte fallback (no unknown pieces), no normalization, whitespace kept.
Ids 0, 1, 2 are <unk>, <s>, </s>; `GPTSentencePieceTokenizer` uses </s> as eod.

    model = train_sentencepiece(["corpus.jsonl"], "out/spm_8192", vocab_size=8192)
    # -> "out/spm_8192.model", written atomically
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Sequence

from megadyn.data.atomic_files import write_bytes_atomic


def iter_training_lines(
    inputs: Sequence[str], json_keys: Sequence[str] = ("text",)
) -> Iterator[str]:
    """Non-blank lines of the inputs; for `.jsonl` / `.json` files, lines of the `json_keys` texts."""
    for path in inputs:
        is_json = path.endswith((".jsonl", ".json"))
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                if not is_json:
                    yield line.rstrip("\n")
                    continue
                record = json.loads(line)
                for key in json_keys:
                    if key not in record:
                        raise KeyError(f"{path}:{line_no}: missing JSON key {key!r}")
                    yield from (s for s in str(record[key]).split("\n") if s.strip())


def train_sentencepiece(
    inputs: Sequence[str],
    model_prefix: str,
    vocab_size: int,
    json_keys: Sequence[str] = ("text",),
    model_type: str = "bpe",
    character_coverage: float = 0.9995,
    byte_fallback: bool = True,
    num_threads: int = 2,
) -> str:
    """Train on `inputs` and write `{model_prefix}.model`; return its path.

    The vocabulary size is a soft limit: a corpus too small for `vocab_size` gets fewer pieces.
    """
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter_training_lines(inputs, json_keys),
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        byte_fallback=byte_fallback,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        input_sentence_size=0,
        max_sentence_length=1 << 16,
        hard_vocab_limit=False,
        num_threads=num_threads,
        minloglevel=2,
    )
    path = model_prefix + ".model"
    write_bytes_atomic(path, model.getvalue())
    return path
