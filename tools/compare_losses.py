"""Compare the per-iteration lm loss of training runs against a reference run.

    python tools/compare_losses.py ref/metrics.jsonl other1/metrics.jsonl other2/metrics.jsonl

Reads the metrics files that pretrain_gpt.py writes (--metrics-file, default
<--save>/metrics.jsonl). Prints, for each run, the largest relative difference from the
reference over the iterations both logged, and the first and last loss.
"""

from __future__ import annotations

import argparse
import os
import sys

from megadyn.training.metrics_log import iterations, read_metrics


def losses(path: str) -> dict[int, float]:
    """lm loss by iteration (the last record of an iteration a resumed run logged again)."""
    return {i: r["losses"]["lm loss"] for i, r in iterations(read_metrics(path)).items()}


def main(paths: list[str]) -> None:
    ref = losses(paths[0])
    print(f"{'run':<40} {'iters':>5} {'first':>9} {'last':>9} {'max rel diff vs ' + paths[0]:>20}")
    for p in paths:
        cur = losses(p)
        common = sorted(set(ref) & set(cur))
        if not common:
            print(f"{p:<40} no iterations in common")
            continue
        diff = max(abs(cur[i] - ref[i]) / abs(ref[i]) for i in common)
        print(
            f"{p:<40} {len(common):>5} {cur[common[0]]:>9.4f} {cur[common[-1]]:>9.4f} {diff:>20.2e}"
        )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tools/compare_losses.py",
        description="Compare the per-iteration lm loss of runs against a reference run: for "
        "each run, the iterations in common, the first and last loss and the largest relative "
        "difference from the reference.",
    )
    reference = "the reference run's metrics file (--metrics-file, or <--save>/metrics.jsonl)"
    parser.add_argument("reference", help=reference)
    parser.add_argument("runs", nargs="*", metavar="run", help="metrics files to compare with it")
    args = parser.parse_args(argv)
    for path in [args.reference, *args.runs]:
        if not os.path.isfile(path):
            parser.error(f"{path}: no such metrics file")
    return args


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    main([args.reference, *args.runs])
