"""megadyn against torchtitan (and, where it can run the shape, Megatron-Core) on the Llama-3-style
model: the rows of scripts/gpu/titan_compare.sh, its megadyn and Megatron-Core commands, and the
table and JSON summary of a run.

    python -m megadyn.bench titan_compare megadyn-args ROW          # tools/bench_gpt.py's flags
    python -m megadyn.bench titan_compare mcore-args ROW            # scripts/gpu/mcore_llama_bench.py's
    python -m megadyn.bench titan_compare summarize results.jsonl --json summary.json

The model (issue 40): 16 layers, hidden 2048, 32 heads, 8 kv heads, ffn 8192, vocab 128256,
untied, RoPE 5e5, RMSNorm, SwiGLU, no biases (1.50 B weights); seq 4096, micro batch 2, 8
sequences per GPU a step (32,768 tokens). Each row is run by every framework in every round;
a cell is the median over rounds, and the ratio of each round is that round's pair. Megatron-Core
runs its local (non-Transformer-Engine) spec, bf16 only: its FP8 needs Transformer Engine, so its
FP8 cells say so. A run that did not happen is a line {"row", "round", "framework", "skipped":
reason} in results.jsonl, and its cell gives the reason.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from megadyn.bench.table import TOKENS, round_ratios

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
MEGADYN_FAST += ["--use-precision-aware-optimizer"]  # 2 bytes less a parameter, a faster update
# on one GPU fc2 keeps its input (1.0 GiB in FP8, 2.0 in bf16), and in bf16 linear_qkv and
# linear_fc1 keep the norms' outputs (1.0 GiB, +1.1% tok/s), under torchtitan's peak; on two
# in FP8 the gradients sharded and the logits by chunks (1.8 and 1.0 GiB less) bring the peak
# under FSDP2's
MEGADYN_ROW = {
    "1gpu_bf16": ["--keep-fc2-input", "--keep-norm-outputs"],
    "1gpu_fp8": ["--keep-fc2-input"],
    "2gpu_fp8": ["--data-parallel-sharding-strategy", "optim_grads", "--cross-entropy-chunks", "4"],
}


MCORE = "megatron-core"
MCORE_FP8 = "n/a: needs Transformer Engine"  # its fp8 context is a no-op without it
FRAMEWORKS = ("megadyn", "torchtitan", MCORE)
STATS = (TOKENS, "mfu", "peak_mem_gib", "peak_reserved_gib", "iter_s", "wall_s")


def megadyn_args(row: str) -> list[str]:
    """tools/bench_gpt.py's flags for `row` (timing flags apart): 8 sequences per GPU."""
    gpus, fp8 = ROWS[row]
    extra = (MEGADYN_FP8 if fp8 else []) + MEGADYN_ROW.get(row, [])
    return LLAMA_SHAPE + ["--gbs", str(8 * gpus)] + MEGADYN_FAST + extra


def mcore_args(row: str) -> list[str] | None:
    """scripts/gpu/mcore_llama_bench.py's flags for `row` (the same model flags and 8 sequences
    per GPU; its dp ranks run the distributed optimizer); None for an FP8 row (MCORE_FP8)."""
    gpus, fp8 = ROWS[row]
    return None if fp8 else LLAMA_SHAPE + ["--gbs", str(8 * gpus)]


def load(path: str) -> tuple[dict, dict]:
    """(row -> framework -> round -> result, row -> framework -> why it did not run)."""
    runs: dict[str, dict[str, dict[int, dict]]] = {}
    skipped: dict[str, dict[str, str]] = {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            if "skipped" in r:
                skipped.setdefault(r["row"], {})[r["framework"]] = r["skipped"]
            else:
                runs.setdefault(r["row"], {}).setdefault(r["framework"], {})[r.get("round", 0)] = r
    return runs, skipped


def median(runs: dict[int, dict] | None, key: str) -> float | None:
    """The median of `key` over the runs that have it (None: no run, or none has it)."""
    values = [r[key] for r in (runs or {}).values() if r.get(key) is not None]
    return statistics.median(values) if values else None


def _cell(runs, key: str, fmt: str) -> str:
    value = median(runs, key)
    return "-" if value is None else fmt.format(value)


def _speed(runs, why: str | None) -> str:
    """'tokens/s (MFU)', or why the framework did not run the row."""
    if not runs and why:
        return why
    return f"{_cell(runs, TOKENS, '{:,.0f}')} ({_cell(runs, 'mfu', '{:.1%}')})"


def _ratio(m, other) -> tuple[str, list[float], float | None]:
    """megadyn / other: the medians' ratio as text, each round's ratio, the ratio (3 places)."""
    mt, ot = median(m, TOKENS), median(other, TOKENS)
    per_round = round_ratios(other, m)
    if not (mt and ot):
        return "-", per_round, None
    return f"{mt / ot:.3f}", per_round, round(mt / ot, 3)


def _rounds(ratios: list[float]) -> str:
    return " ".join(f"{x:.3f}" for x in ratios) or "-"


def _peak(runs) -> str:
    """'allocated (reserved)' GiB."""
    return f"{_cell(runs, 'peak_mem_gib', '{:.1f}')} ({_cell(runs, 'peak_reserved_gib', '{:.1f}')})"


def summarize(path: str) -> tuple[str, dict]:
    """The markdown table of a run's results.jsonl and its JSON summary (per row: each
    framework's medians of tokens/s/GPU, MFU, peak GiB allocated and reserved, step and wall
    seconds; megadyn / torchtitan and megadyn / Megatron-Core, overall and per round; why a
    framework did not run). Megatron-Core's columns appear when the run has any of its lines."""
    runs, skipped = load(path)
    names = set(runs) | set(skipped)
    with_mcore = any(MCORE in runs.get(n, {}) or MCORE in skipped.get(n, {}) for n in names)
    head = "| row | megadyn tok/s/GPU (MFU) | torchtitan tok/s/GPU (MFU) | "
    if with_mcore:
        head += "Megatron-Core tok/s/GPU (MFU) | megadyn / torchtitan | per round "
        head += "| megadyn / Megatron-Core | per round | megadyn peak GiB "
        head += "| torchtitan peak GiB (reserved) | Megatron-Core peak GiB (reserved) |"
    else:
        head += "megadyn / torchtitan | per round | megadyn peak GiB "
        head += "| torchtitan peak GiB (reserved) |"
    lines = [head, "|---" * head.count(" | ") + "|---|"]
    summary = {}
    for name in [r for r in ROWS if r in names] + sorted(r for r in names if r not in ROWS):
        row, why = runs.get(name, {}), skipped.get(name, {})
        m, t, c = (row.get(fw) for fw in FRAMEWORKS)
        tt_text, tt_rounds, tt_ratio = _ratio(m, t)
        mc_text, mc_rounds, mc_ratio = _ratio(m, c)
        entry = {
            fw: {k: median(row.get(fw), k) for k in STATS} if row.get(fw) else None
            for fw in FRAMEWORKS[: 3 if with_mcore else 2]
        }
        entry.update(ratio=tt_ratio, ratios_per_round=[round(x, 3) for x in tt_rounds])
        if with_mcore:
            entry.update(
                ratio_megatron_core=mc_ratio,
                ratios_per_round_megatron_core=[round(x, 3) for x in mc_rounds],
            )
        if why:
            entry["skipped"] = dict(why)
        summary[name] = entry

        cells = [name, _speed(m, why.get("megadyn")), _speed(t, why.get("torchtitan"))]
        if with_mcore:
            cells += [_speed(c, why.get(MCORE)), tt_text, _rounds(tt_rounds), mc_text]
            cells += [_rounds(mc_rounds), _cell(m, "peak_mem_gib", "{:.1f}"), _peak(t), _peak(c)]
        else:
            cells += [tt_text, _rounds(tt_rounds), _cell(m, "peak_mem_gib", "{:.1f}"), _peak(t)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), summary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m megadyn.bench titan_compare", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("megadyn-args", help="tools/bench_gpt.py's flags of a row").add_argument(
        "row", choices=list(ROWS)
    )
    sub.add_parser("mcore-args", help="mcore_llama_bench.py's flags of a row").add_argument(
        "row", choices=list(ROWS)
    )
    s = sub.add_parser("summarize", help="markdown table of results.jsonl on stdout")
    s.add_argument("results")
    s.add_argument("--json", default=None, help="also write the summary here")
    a = p.parse_args(argv)
    if a.command == "megadyn-args":
        print(" ".join(megadyn_args(a.row)))
        return
    if a.command == "mcore-args":  # nothing for an FP8 row: Megatron-Core needs TE for it
        print(" ".join(mcore_args(a.row) or []))
        return
    table, summary = summarize(a.results)
    print(table)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
