"""Table of megadyn vs Megatron-Core benchmark results (JSON lines from scripts/gpu/bench_compare.sh).

python tools/bench_table.py results.jsonl
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    rows: dict[str, dict[str, dict]] = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            rows.setdefault(r["row"], {})[r["framework"]] = r
    print(
        "| row | Megatron-Core tok/s/GPU | megadyn tok/s/GPU | ratio | mcore MFU | megadyn MFU | mcore GiB | megadyn GiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        m, d = r.get("megatron-core"), r.get("megadyn")
        fmt = lambda x, k, f="{:,.0f}": f.format(x[k]) if x else "-"  # noqa: E731
        ratio = f"{d['tokens_per_s_per_gpu'] / m['tokens_per_s_per_gpu']:.3f}" if m and d else "-"
        print(
            f"| {name} | {fmt(m, 'tokens_per_s_per_gpu')} | {fmt(d, 'tokens_per_s_per_gpu')} | {ratio} | "
            f"{fmt(m, 'mfu', '{:.1%}')} | {fmt(d, 'mfu', '{:.1%}')} | {fmt(m, 'peak_mem_gib', '{:.1f}')} | "
            f"{fmt(d, 'peak_mem_gib', '{:.1f}')} |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
