"""The HF export writes the checkpoint's tokenizer, and transformers' AutoTokenizer read from
the exported directory gives the ids megadyn's tokenizer gave in training."""

import json
import os

import pytest
from convert_helpers import TEXTS, export_args, sentencepiece_model, tool

from megadyn.convert.hf_tokenizer import export_tokenizer
from megadyn.data import build_tokenizer
from megadyn.data.gpt2_bpe import bytes_to_unicode

CHECKED = TEXTS + [
    "  two  spaces\nand a new line", " leading space", "x", "", " ", "tabs\tand ✓ ☃ unseen",
]  # fmt: skip


def assert_same_ids(hf_dir, tokenizer, texts=CHECKED, ids_only=()):
    """Equal ids for `texts` and `ids_only`, and equal text back for `texts`."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(hf_dir)
    for text in [*texts, *ids_only]:
        ids = tokenizer.tokenize(text)
        assert hf(text)["input_ids"] == ids, text
        if text in texts:
            assert hf.decode(ids) == tokenizer.detokenize(ids), text
    assert hf.eos_token_id == tokenizer.eod
    return hf


def test_sentencepiece_checkpoint_exports_its_tokenizer(sp_trained, tmp_path, capsys):
    save, model = sp_trained
    out = tmp_path / "hf"
    tool("convert_checkpoint").main(export_args(save, str(out)))
    printed = capsys.readouterr().out
    assert (
        "tokenizer: wrote tokenizer.model, tokenizer.json, tokenizer_config.json from "
        f"GPTSentencePieceTokenizer {model}\n"
    ) in printed
    assert (out / "tokenizer.model").read_bytes() == open(model, "rb").read()
    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    hf = assert_same_ids(str(out), tokenizer)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == hf.eos_token_id == tokenizer.eod


def test_megatron_sentencepiece_and_a_normalizing_unigram_model(tmp_path):
    """SentencePieceTokenizer's appended specials (<EOD> ...) become added tokens at the same
    ids; a unigram model with NFKC and extra-whitespace removal tokenizes as SentencePiece."""
    import sentencepiece

    model = sentencepiece_model(str(tmp_path))
    args = {"data.tokenizer_type": "SentencePieceTokenizer", "data.tokenizer_model": model}
    megatron = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    os.makedirs(tmp_path / "megatron")
    written = export_tokenizer(args, megatron.vocab_size, str(tmp_path / "megatron"))
    assert written.files == ("tokenizer.model", "tokenizer.json", "tokenizer_config.json")
    # Megatron's detokenize sets its specials off with spaces; transformers does not
    assert_same_ids(str(tmp_path / "megatron"), megatron, ids_only=["a <EOD> b<SEP>"])

    unigram = str(tmp_path / "unigram")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS * 20), model_prefix=unigram, vocab_size=400,
        model_type="unigram", normalization_rule_name="nmt_nfkc", byte_fallback=True,
        hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip
    args["data.tokenizer_type"] = "GPTSentencePieceTokenizer"
    args["data.tokenizer_model"] = unigram + ".model"
    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=unigram + ".model")
    os.makedirs(tmp_path / "unigram_hf")
    export_tokenizer(args, tokenizer.vocab_size, str(tmp_path / "unigram_hf"))
    texts = [t for t in CHECKED if t.strip()] + ["  ﬁve  spaces ｆｕｌｌ  "]  # NFKC folds these
    assert_same_ids(str(tmp_path / "unigram_hf"), tokenizer, texts)


def test_hugging_face_tokenizer_files_are_copied(tmp_path):
    """An imported model's tokenizer directory is copied, also when the model has spare rows."""
    model = sentencepiece_model(str(tmp_path))
    args = {"data.tokenizer_type": "GPTSentencePieceTokenizer", "data.tokenizer_model": model}
    os.makedirs(tmp_path / "source")
    export_tokenizer(args, 400, str(tmp_path / "source"))
    args = {
        "data.tokenizer_type": "HuggingFaceTokenizer",
        "data.tokenizer_model": str(tmp_path / "source"),
    }
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "source"))
    os.makedirs(tmp_path / "copy")
    written = export_tokenizer(args, tokenizer.vocab_size + 8, str(tmp_path / "copy"))
    assert written.files == ("tokenizer.json", "tokenizer_config.json")
    assert_same_ids(str(tmp_path / "copy"), tokenizer)


def test_gpt2_bpe_tokenizer_files(tmp_path):
    symbols = list(bytes_to_unicode().values())
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("in", "g")]
    vocab = {s: i for i, s in enumerate(symbols)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    lines = "".join(f"{a} {b}\n" for a, b in merges)
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + lines, encoding="utf-8")
    files = dict(vocab_file=str(tmp_path / "vocab.json"), merge_file=str(tmp_path / "merges.txt"))
    tokenizer = build_tokenizer("GPT2BPETokenizer", **files)
    args = {"data.tokenizer_type": "GPT2BPETokenizer", **{f"data.{k}": v for k, v in files.items()}}
    os.makedirs(tmp_path / "hf")
    written = export_tokenizer(args, tokenizer.vocab_size, str(tmp_path / "hf"))
    assert written.files == ("vocab.json", "merges.txt", "tokenizer_config.json")
    assert_same_ids(str(tmp_path / "hf"), tokenizer, CHECKED + ["the thing in the"])


@pytest.mark.parametrize(
    "args, vocab, message",
    [
        ({}, 61, "none written: the checkpoint records no --tokenizer-type;"),
        (
            {"data.tokenizer_type": "NullTokenizer", "data.vocab_size": 60},
            61,
            "none written: NullTokenizer has no files (its text is token ids)",
        ),
        (
            {"data.tokenizer_type": "GPTSentencePieceTokenizer", "data.tokenizer_model": "t.model"},
            61,
            "none written: GPTSentencePieceTokenizer --tokenizer-model t.model (recorded by the "
            "checkpoint, relative to where training ran?) is not found;",
        ),
        (
            {"data.tokenizer_type": "NullTokenizer", "data.vocab_size": 60},
            64,
            "none written: NullTokenizer has 61 tokens, the model 64;",
        ),
    ],
)
def test_a_tokenizer_that_cannot_be_written_is_named(args, vocab, message, tmp_path):
    written = export_tokenizer(args, vocab, str(tmp_path))
    assert written.files == () and written.message.startswith(message), written.message
    assert os.listdir(tmp_path) == []
