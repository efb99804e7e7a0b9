"""Context parallelism against tensor parallelism and torch's own cp at long sequences, every
row in one process per rank (megadyn/bench/cp_compare.py); or the markdown table of a run.

    torchrun --nproc-per-node 2 tools/bench_cp_compare.py --out runs.jsonl --rounds 2
    python3 tools/bench_cp_compare.py --summarize runs.jsonl
"""

from __future__ import annotations

from megadyn.bench import run_compare_tool
from megadyn.bench.cp_compare import main, parse, summarize

if __name__ == "__main__":
    run_compare_tool(parse, main, summarize)
