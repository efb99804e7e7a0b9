"""Table of megadyn vs Megatron-Core benchmark results (JSON lines from scripts/gpu/bench_compare.sh).

    python tools/bench_table.py results.jsonl          # or: python -m megadyn.bench table ...

With several rounds of the same rows (ROUNDS=N in bench_compare.sh, which alternates the
frameworks and rows within each round), each cell is the median over the rounds and `ratios`
lists the ratio of each round, so that a host whose speed drifts during the command shows as a
spread instead of one lucky or unlucky pair. A row named `base:variant` (a megadyn-only
variant, such as `tp2:graph`) is compared with the Megatron-Core run of its base row.
"""

from __future__ import annotations

import json
import statistics
import sys

TOKENS = "tokens_per_s_per_gpu"


def load(path: str) -> dict[str, dict[str, dict[int, dict]]]:
    """row -> framework -> round -> result."""
    rows: dict[str, dict[str, dict[int, dict]]] = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            rows.setdefault(r["row"], {}).setdefault(r["framework"], {})[r.get("round", 0)] = r
    return rows


def median(runs: dict[int, dict] | None, key: str) -> float | None:
    return statistics.median(r[key] for r in runs.values()) if runs else None


def round_ratios(m: dict[int, dict] | None, d: dict[int, dict] | None) -> list[float]:
    """megadyn / Megatron-Core for each round that ran both."""
    if not m or not d:
        return []
    return [d[k][TOKENS] / m[k][TOKENS] for k in sorted(m.keys() & d.keys())]


def table(rows: dict[str, dict[str, dict[int, dict]]]) -> list[str]:
    lines = [
        "| row | Megatron-Core tok/s/GPU | megadyn tok/s/GPU | ratio | ratios per round "
        "| mcore MFU | megadyn MFU | mcore GiB | megadyn GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(runs, key, fmt="{:,.0f}"):
        value = median(runs, key)
        return "-" if value is None else fmt.format(value)

    for name, r in rows.items():
        base = rows.get(name.split(":")[0], {})  # "tp2:graph" is a megadyn variant of "tp2"
        m, d = r.get("megatron-core") or base.get("megatron-core"), r.get("megadyn")
        mt, dt = median(m, TOKENS), median(d, TOKENS)
        ratio = f"{dt / mt:.3f}" if mt and dt else "-"
        per_round = " ".join(f"{x:.3f}" for x in round_ratios(m, d)) or "-"
        lines.append(
            f"| {name} | {cell(m, TOKENS)} | {cell(d, TOKENS)} | {ratio} | {per_round} | "
            f"{cell(m, 'mfu', '{:.1%}')} | {cell(d, 'mfu', '{:.1%}')} | "
            f"{cell(m, 'peak_mem_gib', '{:.1f}')} | {cell(d, 'peak_mem_gib', '{:.1f}')} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    """Print the table of the results file named by `argv` (default: the command line)."""
    (path,) = sys.argv[1:] if argv is None else argv
    print("\n".join(table(load(path))))


if __name__ == "__main__":
    main()
