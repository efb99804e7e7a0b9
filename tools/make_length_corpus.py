"""Write a synthetic corpus of documents with log-normal lengths in Megatron's .bin/.idx format.

    python tools/make_length_corpus.py --output-prefix /tmp/mix --num-documents 20000 \
        --median 1024 --sigma 1.4 --max-length 32769 --vocab-size 50000 --seed 1

Document lengths are exp(N(ln median, sigma^2)) rounded, clipped to [2, --max-length]; tokens
are uniform random ids below --vocab-size (the data is for timing and for the length mix, not
for learning). Prints the length statistics. What --sample-per-document with
--dynamic-parallelism reads in scripts/gpu/hot_switch.sh.
"""

from __future__ import annotations

import argparse

import numpy as np

from megadyn.data.indexed_dataset import IndexedDatasetWriter, optimal_dtype


def lognormal_lengths(n: int, median: float, sigma: float, max_length: int, seed: int):
    rng = np.random.default_rng(seed)
    lengths = np.rint(np.exp(rng.normal(np.log(median), sigma, n))).astype(np.int64)
    return np.clip(lengths, 2, max_length)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--num-documents", type=int, default=20000)
    p.add_argument("--median", type=float, default=1024)
    p.add_argument("--sigma", type=float, default=1.4)
    p.add_argument("--max-length", type=int, default=32769)
    p.add_argument("--vocab-size", type=int, default=50000)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    lengths = lognormal_lengths(a.num_documents, a.median, a.sigma, a.max_length, a.seed)
    dtype = optimal_dtype(a.vocab_size)
    rng = np.random.default_rng(a.seed + 1)
    with IndexedDatasetWriter(a.output_prefix, dtype) as writer:
        tokens = rng.integers(0, a.vocab_size, int(lengths.sum()), dtype=np.int64).astype(dtype)
        writer.add_raw(tokens.tobytes(), lengths.tolist())
    q = np.percentile(lengths, [50, 90, 99])
    print(
        f"{a.output_prefix}: {len(lengths)} documents, {int(lengths.sum())} tokens; length "
        f"median {q[0]:.0f}, p90 {q[1]:.0f}, p99 {q[2]:.0f}, max {lengths.max()}, mean "
        f"{lengths.mean():.0f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
