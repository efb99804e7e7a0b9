"""Dynamic against static context parallelism on document-masked samples: one layer's
attention and training steps of the reference GPT, in one process per rank
(megadyn/bench/dcp_compare.py); or the markdown tables of a run.

    torchrun --nproc-per-node 2 tools/bench_dcp_compare.py --out dcp.jsonl --seq 32768
    python3 tools/bench_dcp_compare.py --summarize dcp.jsonl
"""

from __future__ import annotations

from megadyn.bench import run_compare_tool
from megadyn.bench.dcp_compare import main, parse, summarize

if __name__ == "__main__":
    run_compare_tool(parse, main, summarize)
