"""Tokenizer files of an exported Hugging Face directory, from the tokenizer a checkpoint records.

    written = export_tokenizer(ckpt.meta["args"], ckpt.cfg.vocab_size, out_dir)
    print(f"tokenizer: {written.message}")     # what was written, or why nothing was

What each `--tokenizer-type` gives (AutoTokenizer.from_pretrained reads the directory after):

    GPTSentencePieceTokenizer  tokenizer.model (the .model file), tokenizer.json built from it
    SentencePieceTokenizer     (same tokenization; Megatron's appended specials as added tokens)
                               and tokenizer_config.json
    GPT2BPETokenizer           vocab.json, merges.txt and tokenizer_config.json (GPT2Tokenizer)
    HuggingFaceTokenizer       its tokenizer.json / tokenizer_config.json / special tokens, copied
    NullTokenizer              nothing: its text is token ids

tokenizer.json reproduces SentencePiece's own steps (its normalization, the dummy "▁" prefix,
spaces as "▁", byte fallback) so that transformers gives the ids training saw: transformers'
LlamaTokenizer rebuilt from tokenizer.model alone drops the dummy prefix before a leading space.
Special tokens written in the text (e.g. "</s>") are one token in transformers, as usual there,
but characters to SentencePiece.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SENTENCEPIECE_TYPES = ("GPTSentencePieceTokenizer", "SentencePieceTokenizer")
# sentencepiece_model.proto: ModelProto.SentencePiece.Type and TrainerSpec.ModelType
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4
UNIGRAM, BPE = 1, 2


@dataclass(frozen=True)
class TokenizerExport:
    """What export_tokenizer wrote into the directory, and the console line that says so."""

    files: tuple[str, ...]
    message: str


def recorded_tokenizer(args: dict[str, Any], vocab_size: int) -> tuple[Any | None, str]:
    """(the tokenizer a checkpoint's flat `args` name (data.tokenizer_type, ...), built from the
    files they record, ""), or (None, why not): no tokenizer recorded, its files gone, or a
    vocabulary other than the model's `vocab_size`."""
    kind = args.get("data.tokenizer_type")
    files = {k: args.get(f"data.{k}") for k in ("tokenizer_model", "vocab_file", "merge_file")}
    if not kind:
        return None, "the checkpoint records no --tokenizer-type"
    flags = {"GPT2BPETokenizer": ("vocab_file", "merge_file"), "NullTokenizer": ()}
    for key in flags.get(kind, ("tokenizer_model",)):
        if not files[key] or not os.path.exists(files[key]):
            path, flag = files[key], "--" + key.replace("_", "-")
            where = "" if not path or os.path.isabs(path) else ", relative to where training ran?"
            return None, f"{kind} {flag} {path} (recorded by the checkpoint{where}) is not found"
    from megadyn.data import build_tokenizer

    try:
        tokenizer = build_tokenizer(kind, vocab_size=args.get("data.vocab_size"), **files)
    except Exception as e:  # noqa: BLE001 - unreadable or foreign files: say so, export the rest
        return None, f"{kind} could not be read ({e})"
    # megadyn sizes the model by its tokenizer; an imported HF model may have spare rows
    spare = kind == "HuggingFaceTokenizer" and tokenizer.vocab_size < vocab_size
    if tokenizer.vocab_size != vocab_size and not spare:
        return None, f"{kind} has {tokenizer.vocab_size} tokens, the model {vocab_size}"
    return tokenizer, ""


def export_tokenizer(args: dict[str, Any], vocab_size: int, out: str) -> TokenizerExport:
    """Write into `out` the HF tokenizer files of the tokenizer a checkpoint's `args` record
    (see recorded_tokenizer), when it has files."""
    tokenizer, reason = recorded_tokenizer(args, vocab_size)
    kind = args.get("data.tokenizer_type")
    if tokenizer is None:
        return TokenizerExport((), f"none written: {reason}; add the tokenizer's files yourself")
    model, vocab, merges = (
        args.get(f"data.{k}") for k in ("tokenizer_model", "vocab_file", "merge_file")
    )
    if kind in SENTENCEPIECE_TYPES:
        files = _write_sentencepiece(tokenizer, model, out)
    elif kind == "GPT2BPETokenizer":
        files = _write_gpt2(vocab, merges, out)
        model = f"{vocab} {merges}"
    elif kind == "HuggingFaceTokenizer":  # its own files, as they are
        directory = model if os.path.isdir(model) else os.path.dirname(model)
        files = [n for n in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(directory, n))]
        for name in files:
            shutil.copy2(os.path.join(directory, name), os.path.join(out, name))
    else:
        return TokenizerExport((), f"none written: {kind} has no files (its text is token ids)")
    return TokenizerExport(tuple(files), f"wrote {', '.join(files)} from {kind} {model}")


def _write_config(out: str, config: dict[str, Any]) -> None:
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


def _write_gpt2(vocab_file: str, merge_file: str, out: str) -> list[str]:
    shutil.copy2(vocab_file, os.path.join(out, "vocab.json"))
    shutil.copy2(merge_file, os.path.join(out, "merges.txt"))
    eod = "<|endoftext|>"
    _write_config(
        out,
        dict(
            tokenizer_class="GPT2Tokenizer",
            bos_token=eod,
            eos_token=eod,
            unk_token=eod,
            add_prefix_space=False,
            add_bos_token=False,
            clean_up_tokenization_spaces=False,
        ),
    )
    return ["vocab.json", "merges.txt", "tokenizer_config.json"]


def _write_sentencepiece(tokenizer, model_file: str, out: str) -> list[str]:
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_file, "rb") as f:
        proto.ParseFromString(f.read())
    backend = sentencepiece_backend(proto)
    pieces = [p.piece for p in proto.pieces]
    appended = getattr(tokenizer, "special_tokens", {})  # Megatron's SentencePieceTokenizer
    extra = sorted((i, t) for t, i in appended.items() if i >= len(pieces))
    from tokenizers import AddedToken

    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in extra])
    names = pieces + [t for _, t in extra]
    shutil.copy2(model_file, os.path.join(out, "tokenizer.model"))
    backend.save(os.path.join(out, "tokenizer.json"))
    spec = proto.trainer_spec
    config = dict(
        tokenizer_class="PreTrainedTokenizerFast",  # tokenizer.json as written, nothing rebuilt
        eos_token=names[tokenizer.eod],
        unk_token=pieces[spec.unk_id],
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
    )
    for key, piece_id in (("bos_token", spec.bos_id), ("pad_token", spec.pad_id)):
        if 0 <= piece_id < len(pieces):
            config[key] = pieces[piece_id]
    _write_config(out, config)
    return ["tokenizer.model", "tokenizer.json", "tokenizer_config.json"]


def sentencepiece_backend(proto):
    """A `tokenizers.Tokenizer` that tokenizes as the SentencePiece model `proto` (BPE or
    unigram): its normalization, extra-whitespace removal, dummy prefix and byte fallback."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers

    spec, norm = proto.trainer_spec, proto.normalizer_spec
    pieces = list(proto.pieces)
    unk = pieces[spec.unk_id].piece
    if spec.model_type == BPE:
        vocab = {p.piece: i for i, p in enumerate(pieces)}
        merges = []  # a piece's merges rank by its id (SentencePiece orders pieces by score)
        for i, p in enumerate(pieces):
            if p.type != NORMAL:
                continue
            for cut in range(1, len(p.piece)):
                left, right = p.piece[:cut], p.piece[cut:]
                if left in vocab and right in vocab:
                    merges.append((i, vocab[left], vocab[right], left, right))
        merges.sort()
        model = models.BPE(
            vocab, [(a, b) for *_, a, b in merges], unk_token=unk, fuse_unk=True,
            byte_fallback=spec.byte_fallback,
        )  # fmt: skip
    elif spec.model_type == UNIGRAM:
        vocab = [(p.piece, p.score) for p in pieces]
        model = models.Unigram(vocab, unk_id=spec.unk_id, byte_fallback=spec.byte_fallback)
    else:
        raise ValueError(f"SentencePiece model type {spec.model_type} (only BPE and unigram)")
    steps = []
    if norm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    steps.append(normalizers.Replace(" ", "▁"))
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Sequence(steps)
    backend.pre_tokenizer = None
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if norm.add_dummy_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode)
    specials = [p.piece for p in pieces if p.type in (UNKNOWN, CONTROL)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    user = [p.piece for p in pieces if p.type == USER_DEFINED]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return backend
