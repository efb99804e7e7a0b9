"""How much of a step's communication the GPU hides behind compute, from a torch.profiler trace.

Prints one JSON line: the figures of megadyn/bench/trace_overlap.py (also
`python -m megadyn.bench trace_overlap`).

Usage: python3 tools/trace_overlap.py TRACE.json [--steps N]   (figures divided by N)
"""

from megadyn.bench.trace_overlap import main

if __name__ == "__main__":
    main()
