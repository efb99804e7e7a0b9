"""Table of megadyn vs Megatron-Core benchmark results (JSON lines from scripts/gpu/bench_compare.sh);
the logic is megadyn/bench/table.py.

python tools/bench_table.py results.jsonl
"""

from megadyn.bench.table import main

if __name__ == "__main__":
    main()
