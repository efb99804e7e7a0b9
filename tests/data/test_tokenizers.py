"""Every --tokenizer-type round-trips text; GPT-2 BPE matches Hugging Face's on the same files."""

from __future__ import annotations

import json
import sys

import pytest
from data_helpers import SENTENCES

from megadyn.data.tokenizers import TOKENIZER_TYPES, build_tokenizer

TEXT = "\n".join(SENTENCES) + "\n  indented  text\twith tabs\n"


def _round_trip(tokenizer, text: str = TEXT) -> list[int]:
    ids = tokenizer.tokenize(text)
    assert ids and all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.detokenize(ids) == text
    assert 0 <= tokenizer.eod < tokenizer.vocab_size
    return ids


def test_gpt_sentencepiece(sp_model):
    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp_model)
    _round_trip(tokenizer)
    assert tokenizer.eod == tokenizer.processor.eos_id() == 2


def test_megatron_sentencepiece_adds_special_tokens(sp_model):
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    base = tokenizer.processor.get_piece_size()
    _round_trip(tokenizer)
    assert tokenizer.eod == tokenizer.special_tokens["<EOD>"] >= base
    ids = tokenizer.tokenize("left<EOD>right")
    assert tokenizer.eod in ids
    assert tokenizer.detokenize(ids) == "left <EOD> right"


def test_gpt2_bpe_round_trip_and_matches_huggingface(gpt2_files):
    vocab_file, merge_file = gpt2_files
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    ids = _round_trip(tokenizer)
    encoder = tokenizer.bpe.encoder
    assert tokenizer.tokenize(" the data") == [encoder["Ġthe"], encoder["Ġdata"]]
    tokenizers = pytest.importorskip("tokenizers")
    reference = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(vocab_file, merge_file))
    reference.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert reference.encode(TEXT).ids == ids


def test_huggingface_tokenizer_from_directory(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.models.BPE(unk_token=None)
    hf = tokenizers.Tokenizer(model)
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(SENTENCES * 10, trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    _round_trip(tokenizer)
    assert tokenizer.eod == hf.token_to_id("<|endoftext|>")
    single_file = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tokenizer.json"))
    assert single_file.tokenize(TEXT) == tokenizer.tokenize(TEXT)


def test_null_tokenizer():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tokenizer.tokenize("3 1 4 1 5") == [3, 1, 4, 1, 5]
    assert tokenizer.detokenize([3, 1, 4]) == "3 1 4"
    assert (tokenizer.eod, tokenizer.vocab_size) == (100, 101)


def test_bad_arguments_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--tokenizer-type 'Bert'"):
        build_tokenizer("Bert")
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer("GPTSentencePieceTokenizer")
    with pytest.raises(FileNotFoundError, match="--tokenizer-model .*missing.model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "missing.model"))
    with pytest.raises(ValueError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=__file__)
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")
    assert len(TOKENIZER_TYPES) == 5


def test_huggingface_without_tokenizers_package_names_the_flag(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
