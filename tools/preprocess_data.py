"""Tokenize jsonl / parquet / Hugging Face `datasets` input into Megatron indexed datasets.

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model spm.model \
        --output-prefix data/corpus --append-eod --workers 2
    # writes data/corpus_text_document.bin and .idx (use --data-path data/corpus_text_document)
"""

from __future__ import annotations

import argparse
import logging
import sys

from megadyn.data.preprocess import PreprocessError, preprocess_data
from megadyn.data.tokenizers import TOKENIZER_TYPES


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="jsonl, parquet or a save_to_disk directory")
    group.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys (columns) to tokenize"
    )
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", default=None, help="SentencePiece model / HF tokenizer")
    group.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT-2 merges.txt")
    group.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    group.add_argument("--append-eod", action="store_true", help="append eod to each document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="path prefix of the outputs")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between reports")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = get_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        result = preprocess_data(
            args.input,
            args.output_prefix,
            args.tokenizer_type,
            tokenizer_model=args.tokenizer_model,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            vocab_size=args.vocab_size,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            log_interval=args.log_interval,
            progress=not args.no_progress,
        )
    except (PreprocessError, FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    rate = result.input_bytes / max(result.seconds, 1e-9) / 2**20
    for key, prefix in result.output_prefixes.items():
        print(
            f"{prefix}: {result.documents[key]} documents, {result.tokens[key]} tokens, "
            f"{result.empty_documents[key]} empty skipped"
        )
    print(f"{result.input_records} records, {result.seconds:.1f} s, {rate:.2f} MB/s")


if __name__ == "__main__":
    main()
