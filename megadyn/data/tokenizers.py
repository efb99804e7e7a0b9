"""Tokenizers under Megatron-LM's `--tokenizer-type` names, built by `build_tokenizer`.

Every tokenizer has `.vocab_size`, `.tokenize(text) -> list[int]`, `.detokenize(ids) -> str`
and `.eod` (the id appended by `--append-eod` and used as the document separator):

    SentencePieceTokenizer     --tokenizer-model m.model; appends Megatron's specials (<CLS>,
                               <SEP>, <EOD>, <MASK>, pad/bos/eos) when the model lacks them;
                               eod is <EOD>
    GPTSentencePieceTokenizer  --tokenizer-model m.model; the model's own ids; eod is its eos
    HuggingFaceTokenizer       --tokenizer-model a directory with tokenizer.json, or the file;
                               read with the `tokenizers` package; eod is the eos token
    GPT2BPETokenizer           --vocab-file vocab.json --merge-file merges.txt; pure-Python
                               byte-level BPE; eod is <|endoftext|>
    NullTokenizer              --vocab-size V; text is space-separated ids; eod is V and
                               vocab_size is V + 1 (as in Megatron-LM)

    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model="spm.model")
"""

from __future__ import annotations

import json
import os
import re
from typing import Protocol

from megadyn.data.gpt2_bpe import ByteLevelBPE

TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "NullTokenizer",
)
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")


class Tokenizer(Protocol):
    """What every tokenizer here provides."""

    vocab_size: int
    eod: int

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: list[int]) -> str: ...


def _require_file(path: str | None, flag: str, tokenizer_type: str) -> str:
    if path is None:
        raise ValueError(f"{tokenizer_type} needs {flag}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{flag} {path}: no such file")
    return path


class GPTSentencePieceTokenizer:
    """A SentencePiece model used as is; eod is the model's eos id."""

    def __init__(self, model_file: str) -> None:
        import sentencepiece

        self.model_file = model_file
        self.processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = self.processor.get_piece_size()
        self.eod = self.processor.eos_id()
        if self.eod < 0:
            raise ValueError(f"--tokenizer-model {model_file} has no eos piece to use as eod")

    def tokenize(self, text: str) -> list[int]:
        return self.processor.encode_as_ids(text)

    def detokenize(self, ids: list[int]) -> str:
        return self.processor.decode_ids([int(i) for i in ids])


class SentencePieceTokenizer:
    """Megatron's SentencePieceTokenizer: the model plus special tokens appended after it."""

    def __init__(self, model_file: str) -> None:
        import sentencepiece

        self.model_file = model_file
        self.processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
        size = self.processor.get_piece_size()
        self.vocab = {self.processor.id_to_piece(i): i for i in range(size)}
        self.special_tokens: dict[str, int] = {}
        for token in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            self._add_special(token)
        for piece_id, default in (
            (self.processor.pad_id(), "<PAD>"),
            (self.processor.bos_id(), "<BOS>"),
            (self.processor.eos_id(), "<EOS>"),
        ):
            self._add_special(
                self.processor.id_to_piece(piece_id) if 0 <= piece_id < size else default
            )
        self.vocab_size = len(self.vocab)
        self.eod = self.special_tokens["<EOD>"]
        self.inv_special = {i: t for t, i in self.special_tokens.items()}
        self._split = re.compile("(" + "|".join(map(re.escape, self.special_tokens)) + ")")

    def _add_special(self, token: str) -> None:
        self.vocab.setdefault(token, len(self.vocab))
        self.special_tokens[token] = self.vocab[token]

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(self._split.split(text)):
            if i % 2:  # odd parts are the special tokens matched by the split pattern
                ids.append(self.special_tokens[part])
            elif part:
                ids.extend(self.processor.encode_as_ids(part))
        return ids

    def detokenize(self, ids: list[int]) -> str:
        """As Megatron: special tokens are set off by spaces."""
        text, run = "", []
        for i in map(int, ids):
            if i in self.inv_special:
                text += self.processor.decode_ids(run) + " " + self.inv_special[i] + " "
                run = []
            else:
                run.append(i)
        return text + self.processor.decode_ids(run)


class HuggingFaceTokenizer:
    """A Hugging Face fast tokenizer (`tokenizer.json`) read with the `tokenizers` package."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError(
                f"HuggingFaceTokenizer needs the `tokenizers` package to read --tokenizer-model "
                f"{path} (pip install tokenizers)"
            ) from None
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"--tokenizer-model {path}: no tokenizer.json found")
        self.tokenizer = Tokenizer.from_file(file)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._eod = self._find_eos(directory)
        self.path = path

    def _find_eos(self, directory: str) -> int | None:
        config = os.path.join(directory, "tokenizer_config.json")
        names = list(_EOS_CANDIDATES)
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            names = ([eos] if eos else []) + names
        for name in names:
            token_id = self.tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    @property
    def eod(self) -> int:
        if self._eod is None:
            raise ValueError(f"--tokenizer-model {self.path}: no end-of-text token found")
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


class GPT2BPETokenizer:
    """GPT-2's byte-level BPE from `vocab.json` and `merges.txt`."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        self.bpe = ByteLevelBPE.from_files(vocab_file, merge_file)
        self.vocab_size = len(self.bpe.encoder)
        if "<|endoftext|>" not in self.bpe.encoder:
            raise ValueError(f"--vocab-file {vocab_file} has no <|endoftext|> token for eod")
        self.eod = self.bpe.encoder["<|endoftext|>"]

    def tokenize(self, text: str) -> list[int]:
        return self.bpe.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        return self.bpe.decode(ids)


class NullTokenizer:
    """Text is space-separated token ids; eod is `vocab_size` (ids 0..V-1 are data)."""

    def __init__(self, vocab_size: int) -> None:
        self.eod = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    vocab_size: int | None = None,
) -> Tokenizer:
    """Build the tokenizer named by `--tokenizer-type` from the files its flags name."""
    by_model = {
        "SentencePieceTokenizer": SentencePieceTokenizer,
        "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
        "HuggingFaceTokenizer": HuggingFaceTokenizer,
    }
    if tokenizer_type in by_model:
        model = _require_file(tokenizer_model, "--tokenizer-model", tokenizer_type)
        return by_model[tokenizer_type](model)
    if tokenizer_type == "GPT2BPETokenizer":
        vocab = _require_file(vocab_file, "--vocab-file", tokenizer_type)
        return GPT2BPETokenizer(vocab, _require_file(merge_file, "--merge-file", tokenizer_type))
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise ValueError(
        f"unknown --tokenizer-type {tokenizer_type!r}; expected one of {', '.join(TOKENIZER_TYPES)}"
    )
