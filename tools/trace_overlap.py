"""How much of a step's communication the GPU hides behind compute, from a torch.profiler trace.

Prints one JSON line: the figures of megadyn/bench/trace_overlap.py.

Usage: python3 tools/trace_overlap.py TRACE.json [--steps N]   (figures divided by N)
"""

from __future__ import annotations

import argparse
import json

from megadyn.bench.trace_overlap import summarize


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=1)
    a = p.parse_args()
    with open(a.trace) as f:
        print(json.dumps(summarize(json.load(f), a.steps)))


if __name__ == "__main__":
    main()
