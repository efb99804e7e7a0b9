"""megadyn against torchtitan on the Llama-3-style model: the rows of scripts/gpu/titan_compare.sh,
its megadyn commands, and the table and JSON summary of a run.

    python -m megadyn.bench titan_compare megadyn-args ROW          # tools/bench_gpt.py's flags
    python -m megadyn.bench titan_compare summarize results.jsonl --json summary.json

The model (issue 40): 16 layers, hidden 2048, 32 heads, 8 kv heads, ffn 8192, vocab 128256,
untied, RoPE 5e5, RMSNorm, SwiGLU, no biases (1.50 B weights); seq 4096, micro batch 2, 8
sequences per GPU a step (32,768 tokens). Each row is run by both frameworks in every round;
a cell is the median over rounds, and the ratio of each round is that round's pair.
"""

from __future__ import annotations

import argparse
import json
import sys

from megadyn.bench.table import TOKENS, load, median, round_ratios

LLAMA_SHAPE = (
    "--layers 16 --hidden 2048 --heads 32 --group-query-attention --num-query-groups 8 "
    "--ffn-hidden-size 8192 --vocab 128256 --seq 4096 --mbs 2 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --rotary-base 500000 --disable-bias-linear "
    "--untie-embeddings-and-output-weights"
).split()
ROWS = {  # name: (GPUs, fp8)
    "1gpu_bf16": (1, False),
    "1gpu_fp8": (1, True),
    "2gpu_bf16": (2, False),
    "2gpu_fp8": (2, True),
}
MEGADYN_FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
MEGADYN_FAST = ["--cuda-graph", "--pointwise-fusion"]  # each measured faster on the 1-GPU rows


def megadyn_args(row: str) -> list[str]:
    """tools/bench_gpt.py's flags for `row` (timing flags apart): 8 sequences per GPU."""
    gpus, fp8 = ROWS[row]
    return LLAMA_SHAPE + ["--gbs", str(8 * gpus)] + MEGADYN_FAST + (MEGADYN_FP8 if fp8 else [])


def _cell(runs, key: str, fmt: str) -> str:
    value = median(runs, key)
    return "-" if value is None else fmt.format(value)


def summarize(path: str) -> tuple[str, dict]:
    """The markdown table of a run's results.jsonl and its JSON summary (per row: each
    framework's median tokens/s/GPU, MFU and peak GiB, the ratio and the ratio per round)."""
    rows = load(path)
    lines = [
        "| row | megadyn tok/s/GPU (MFU) | torchtitan tok/s/GPU (MFU) | megadyn / torchtitan "
        "| per round | megadyn peak GiB | torchtitan peak GiB (reserved) |",
        "|---|---|---|---|---|---|---|",
    ]
    summary = {}
    for name in [r for r in ROWS if r in rows] + [r for r in rows if r not in ROWS]:
        m, t = rows[name].get("megadyn"), rows[name].get("torchtitan")
        mt, tt = median(m, TOKENS), median(t, TOKENS)
        ratios = round_ratios(t, m)
        summary[name] = dict(
            megadyn={k: median(m, k) for k in (TOKENS, "mfu", "peak_mem_gib")} if m else None,
            torchtitan={k: median(t, k) for k in (TOKENS, "mfu", "peak_mem_gib")} if t else None,
            ratio=round(mt / tt, 3) if mt and tt else None,
            ratios_per_round=[round(x, 3) for x in ratios],
        )
        ratio = f"{mt / tt:.3f}" if mt and tt else "-"
        lines.append(
            f"| {name} | {_cell(m, TOKENS, '{:,.0f}')} ({_cell(m, 'mfu', '{:.1%}')}) "
            f"| {_cell(t, TOKENS, '{:,.0f}')} ({_cell(t, 'mfu', '{:.1%}')}) "
            f"| {ratio} | {' '.join(f'{x:.3f}' for x in ratios) or '-'} "
            f"| {_cell(m, 'peak_mem_gib', '{:.1f}')} | {_cell(t, 'peak_mem_gib', '{:.1f}')} "
            f"({_cell(t, 'peak_reserved_gib', '{:.1f}')}) |"
        )
    return "\n".join(lines), summary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m megadyn.bench titan_compare", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("megadyn-args", help="tools/bench_gpt.py's flags of a row").add_argument(
        "row", choices=list(ROWS)
    )
    s = sub.add_parser("summarize", help="markdown table of results.jsonl on stdout")
    s.add_argument("results")
    s.add_argument("--json", default=None, help="also write the summary here")
    a = p.parse_args(argv)
    if a.command == "megadyn-args":
        print(" ".join(megadyn_args(a.row)))
        return
    table, summary = summarize(a.results)
    print(table)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
