"""Train a SentencePiece tokenizer model on text or jsonl files.

    python tools/train_tokenizer.py --input corpus.jsonl --json-keys text \
        --model-prefix data/spm_8192 --vocab-size 8192
    # then: --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model data/spm_8192.model
"""

from __future__ import annotations

import argparse

from megadyn.data.sp_train import train_sentencepiece


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="text or .jsonl files")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys of .jsonl input")
    parser.add_argument("--model-prefix", required=True, help="writes PREFIX.model")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--model-type", default="bpe", choices=["bpe", "unigram", "char", "word"])
    parser.add_argument("--character-coverage", type=float, default=0.9995)
    parser.add_argument("--no-byte-fallback", action="store_true")
    parser.add_argument("--workers", type=int, default=2, help="SentencePiece trainer threads")
    args = parser.parse_args(argv)
    path = train_sentencepiece(
        args.input,
        args.model_prefix,
        args.vocab_size,
        json_keys=args.json_keys,
        model_type=args.model_type,
        character_coverage=args.character_coverage,
        byte_fallback=not args.no_byte_fallback,
        num_threads=args.workers,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
