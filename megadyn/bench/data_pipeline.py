"""Benchmark of the data pipeline (not a test): preprocessing throughput and loader speed.

    python -m megadyn.bench data_pipeline --out-dir /tmp/megadyn_bench_data

1. Preprocessing: the default corpus (stdlib docs, repeated to --corpus-mb MB) tokenized with its
   SentencePiece model, with 1 and 2 worker processes: MB/s and documents/s.
2. Loader: micro batches per second of `MicroBatchLoader` for the 1.42 B reference shape
   (seq 2048, micro batch 2, vocab 50304) over a GPTDataset of random tokens, and over mock data.
   An H200 trains such a micro batch in about 80 ms, so the loader must give > 125 per second.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from megadyn.data.default_corpus import prepare_default_data
from megadyn.data.gpt_dataset import GPTDataset
from megadyn.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, optimal_dtype
from megadyn.data.loader import MicroBatchLoader
from megadyn.data.mock_dataset import MockGPTDataset
from megadyn.data.preprocess import preprocess_data

SEQ_LENGTH, MICRO_BATCH, VOCAB = 2048, 2, 50304
GPU_SECONDS_PER_MICRO_BATCH = 0.080


def bench_preprocess(out_dir: str, corpus_mb: float) -> None:
    paths = prepare_default_data(os.path.join(out_dir, "default"))
    corpus = os.path.join(out_dir, "default", "stdlib_docs.jsonl")
    big = os.path.join(out_dir, f"corpus_{corpus_mb:g}mb.jsonl")
    if not os.path.isfile(big):
        text = open(corpus, "rb").read()
        with open(big, "wb") as f:
            for _ in range(max(1, round(corpus_mb * 2**20 / len(text)))):
                f.write(text)
    size_mb = os.path.getsize(big) / 2**20
    print(f"preprocess: {big} ({size_mb:.1f} MB), GPTSentencePieceTokenizer (vocab 8192)")
    for workers in (1, 2):
        start = time.perf_counter()
        result = preprocess_data(
            big,
            os.path.join(out_dir, f"pre_w{workers}"),
            "GPTSentencePieceTokenizer",
            tokenizer_model=paths["tokenizer_model"],
            append_eod=True,
            workers=workers,
        )
        seconds = time.perf_counter() - start
        docs = result.documents["text"]
        print(
            f"  workers={workers}: {size_mb / seconds:6.2f} MB/s  {docs / seconds:8.0f} docs/s  "
            f"({result.tokens['text'] / seconds / 1e6:.2f} M tokens/s, {seconds:.2f} s)"
        )


def synthetic_dataset(out_dir: str, num_tokens: int) -> str:
    """Random documents (lengths ~ lognormal, mean ~1,000 tokens) over a 50304 vocabulary."""
    prefix = os.path.join(out_dir, f"random_{num_tokens}")
    if IndexedDataset.exists(prefix):
        return prefix
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, optimal_dtype(VOCAB)) as writer:
        written = 0
        while written < num_tokens:
            length = int(min(rng.lognormal(6.5, 1.0), 20_000)) + 1
            writer.add_document(rng.integers(0, VOCAB, length))
            written += length
    return prefix


def rate(loader: MicroBatchLoader, batches: int) -> float:
    for _ in range(20):  # warm-up (and fill the prefetch queue)
        next(loader)
    start = time.perf_counter()
    for _ in range(batches):
        batch = next(loader)
    seconds = time.perf_counter() - start
    assert batch["tokens"].shape == (MICRO_BATCH, SEQ_LENGTH)
    loader.close()
    return batches / seconds


def bench_loader(out_dir: str, num_tokens: int, batches: int) -> None:
    prefix = synthetic_dataset(out_dir, num_tokens)
    indexed = IndexedDataset(prefix)
    cache = os.path.join(out_dir, "cache")
    num_samples = 50_000
    start = time.perf_counter()
    dataset = GPTDataset(indexed, np.arange(len(indexed)), SEQ_LENGTH, 1234, num_samples, cache)
    built = time.perf_counter() - start
    print(
        f"loader: GPTDataset over {num_tokens / 1e6:.0f} M random tokens, {indexed.num_documents} "
        f"docs, {len(dataset)} samples of seq {SEQ_LENGTH} (indices ready in {built:.2f} s)"
    )
    need = 10 / GPU_SECONDS_PER_MICRO_BATCH
    cases = [
        ("GPTDataset, dp 1, synchronous", dataset, 0, 1, 0),
        ("GPTDataset, dp 8 rank 5, synchronous", dataset, 5, 8, 0),
        ("GPTDataset, dp 1, 2 prefetch threads", dataset, 0, 1, 2),
        (
            "MockGPTDataset, dp 1, synchronous",
            MockGPTDataset(VOCAB, SEQ_LENGTH, 1234, 10**6),
            0,
            1,
            0,
        ),
    ]
    print(f"  micro batch {MICRO_BATCH} x seq {SEQ_LENGTH}, vocab {VOCAB}; need > {need:.0f}/s")
    for name, data, rank, dp, workers in cases:
        loader = MicroBatchLoader(
            data, MICRO_BATCH, rank, dp, consumed_samples=1000, num_workers=workers
        )
        per_second = rate(loader, batches)
        print(
            f"  {name:40s} {per_second:9.0f} micro batches/s "
            f"({per_second * GPU_SECONDS_PER_MICRO_BATCH:.0f}x an 80 ms GPU step)"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", default="/tmp/megadyn_bench_data")
    parser.add_argument("--corpus-mb", type=float, default=10.0)
    parser.add_argument("--loader-tokens", type=int, default=50_000_000)
    parser.add_argument("--batches", type=int, default=2000)
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"cpu cores available: {len(os.sched_getaffinity(0))}")
    bench_preprocess(args.out_dir, args.corpus_mb)
    bench_loader(args.out_dir, args.loader_tokens, args.batches)


if __name__ == "__main__":
    main()
