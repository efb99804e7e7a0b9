"""Compare the per-iteration lm loss of training logs against a reference log.

    python tools/compare_losses.py ref.log other1.log other2.log
Prints, for each log, the largest relative difference from the reference over the iterations
both logged, and the first and last loss.
"""

from __future__ import annotations

import re
import sys

LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|")


def losses(path: str) -> dict[int, float]:
    with open(path, errors="replace") as f:
        return {int(m.group(1)): float(m.group(2)) for m in map(LINE.search, f) if m}


def main(paths: list[str]) -> None:
    ref = losses(paths[0])
    print(f"{'log':<40} {'iters':>5} {'first':>9} {'last':>9} {'max rel diff vs ' + paths[0]:>20}")
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


if __name__ == "__main__":
    main(sys.argv[1:])
