"""Context parallelism against tensor parallelism and torch's own cp, at long sequences, in one
process per rank (tools/bench_cp_compare.py; scripts/gpu/cp_compare.sh runs it on 2 GPUs).

    torchrun --nproc-per-node 2 tools/bench_cp_compare.py --out runs.jsonl \\
        --seqs 8192 16384 32768 --rows cp2 tp2 tp2_sp torch_cp2 --rounds 2 --budget-s 300
    python3 tools/bench_cp_compare.py --summarize runs.jsonl       # markdown table

Every row trains the reference GPT (megadyn/bench/gpt.py's shape) for `--warmup` + `--iters`
steps of `--tokens` tokens (micro batch 1, global batch tokens / seq) and appends its record
to `--out`. Rows run in turn at each length, their order reversed every other round, so a
slow phase of the machine does not fall on one row. `--extra ROW@SEQ[:full]` runs once after
the rounds (the longest lengths; `:full` recomputes every layer); `--recompute-from SEQ` makes
the rounds' runs at SEQ and longer recompute every layer. Other flags go to gpt.py (`--layers 2 --hidden 64`). A row that would not end
within `--budget-s` is skipped and recorded as such; one that fails alike on every rank is
recorded with its error; one that runs out of memory is recorded as `oom` and ends the runs
(what it leaves behind spoiled or hung the runs after it on GPUs).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
import torch.distributed as dist

from megadyn.bench.gpt import parse_args, run_gpt_bench
from megadyn.bench.torch_cp import run_torch_cp_bench

ROWS = {  # name: megadyn/bench/gpt.py flags (world of 2); None: torch's context parallelism
    "cp2": ["--cp", "2"],
    "cp2_flash": ["--cp", "2", "--attention-backend", "flash"],  # the ring's flash blocks
    "cp2_a2a": ["--cp", "2", "--cp-comm-type", "a2a"],  # heads for sequence, one kernel call
    "tp2": ["--tp", "2"],
    "tp2_sp": ["--tp", "2", "--sp"],
    "torch_cp2": None,
}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON lines, one record per run (appended)")
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32768, help="tokens per iteration")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--extra", nargs="*", default=[], help="ROW@SEQ[:full], once, after the rounds")
    p.add_argument(
        "--recompute-from",
        type=int,
        default=None,
        help="rows of the rounds at this length and longer recompute every layer",
    )
    p.add_argument("--budget-s", type=float, default=1e9, help="skip runs that would end later")
    p.add_argument("--summarize", help="print the markdown table of this JSON-lines file")
    c, c.model_flags = p.parse_known_args(argv)  # the rest: gpt.py's flags (--layers, ...)
    return c


def row_args(row: str, seq: int, c: argparse.Namespace, recompute: str = "none"):
    flags = (ROWS[row] or []) + c.model_flags
    return parse_args(
        flags
        + ["--seq", str(seq), "--mbs", "1", "--gbs", str(max(1, c.tokens // seq))]
        + ["--iters", str(c.iters), "--warmup", str(c.warmup), "--recompute", recompute]
    )


def guarded(device, run, *args) -> dict:
    """The record `run(*args)` returns, or {"oom": True} when it ran out of memory, or its
    error; its memory on `device` freed after."""
    try:
        rec = run(*args)
    except torch.OutOfMemoryError as err:
        rec = dict(oom=True, error=str(err).splitlines()[0])
    except Exception as err:  # an unsupported shape or kernel fails on every rank alike
        rec = dict(error=f"{type(err).__name__}: {str(err).splitlines()[0]}")
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def run_row(row: str, seq: int, c, device, recompute: str = "none") -> dict:
    """One run's record ({"oom": True} when it ran out of memory), its memory freed after."""
    a = row_args(row, seq, c, recompute)
    bench = run_torch_cp_bench if ROWS[row] is None else run_gpt_bench
    rec = guarded(device, bench, a, device)
    return dict(rec, row=row, seq=seq, recompute=recompute)


def plan(c: argparse.Namespace) -> list[tuple[int, str, int, str]]:
    """(round, row, seq, recompute) in running order."""
    runs = []
    for r in range(c.rounds):
        order = c.rows if r % 2 == 0 else c.rows[::-1]
        for seq in c.seqs:
            full = c.recompute_from is not None and seq >= c.recompute_from
            runs += [(r, row, seq, "full" if full else "none") for row in order]
    for spec in c.extra:
        row, rest = spec.split("@")
        seq, _, recompute = rest.partition(":")
        runs.append((-1, row, int(seq), recompute or "none"))
    return runs


def main(c: argparse.Namespace, device) -> None:
    start, seconds = time.perf_counter(), {}  # (row, seq) -> seconds of its last run
    for rnd, row, seq, recompute in plan(c):
        guess = seconds.get((row, seq), seconds.get((row, seq // 2), 0.0) * 2.5)
        late = [time.perf_counter() - start + guess > c.budget_s]
        dist.broadcast_object_list(late, src=0)  # every rank skips the same runs
        if late[0]:
            rec = dict(row=row, seq=seq, recompute=recompute, skipped="budget")
        else:
            t0 = time.perf_counter()
            rec = run_row(row, seq, c, device, recompute)
            seconds[(row, seq)] = time.perf_counter() - t0
        rec["round"] = rnd
        if dist.get_rank() == 0:
            print(json.dumps(rec), flush=True)
            if c.out:
                with open(c.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
        if rec.get("oom"):  # what the failed run left behind (memory, half-used communicators)
            return  # would spoil or hang the runs after it


def summarize(path: str) -> str:
    """Markdown: per length and row the median over rounds of tokens/s/GPU, MFU and peak
    memory, cp2's ratio to tp2 and to torch's cp per round; extra runs listed after."""
    recs = [json.loads(line) for line in open(path) if line.strip()]
    lines = [
        "| seq | row | tokens/s/GPU (median) | per round | MFU | peak GiB | recompute |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        r.setdefault("recompute", "none")
    keys = sorted({(r["seq"], r["row"], r["recompute"]) for r in recs})
    for seq, row, rc in keys:
        runs = [r for r in recs if (r["seq"], r["row"], r["recompute"]) == (seq, row, rc)]
        ok = [r for r in runs if "tokens_per_s_per_gpu" in r]
        if not ok:
            why = "oom" if any(r.get("oom") for r in runs) else runs[0].get("error", "skipped")
            lines.append(f"| {seq} | {row} | {why} | | | | {rc} |")
            continue
        tps = [r["tokens_per_s_per_gpu"] for r in ok]
        lines.append(
            f"| {seq} | {row} | {statistics.median(tps):,.0f} | {' '.join(f'{t:,.0f}' for t in tps)}"
            f" | {statistics.median(r['mfu'] for r in ok):.1%} | {max(r['peak_mem_gib'] for r in ok)}"
            f" | {rc} |"
        )
    lines += [
        "",
        "| seq | round | cp row | / tp2 | / tp2_sp | / torch_cp2 |",
        "|---|---|---|---|---|---|",
    ]
    by = {(r["seq"], r["row"], r["round"]): r.get("tokens_per_s_per_gpu") for r in recs}
    cp_rows = [row for row in ROWS if row.startswith("cp2") and any(r["row"] == row for r in recs)]
    for seq, rnd in sorted({(r["seq"], r["round"]) for r in recs if r["round"] >= 0}):
        for row in cp_rows:
            cp = by.get((seq, row, rnd))
            ratios = [
                f"{cp / other:.3f}" if cp and other else "-"
                for other in (by.get((seq, o, rnd)) for o in ("tp2", "tp2_sp", "torch_cp2"))
            ]
            lines.append(f"| {seq} | {rnd} | {row} | {' | '.join(ratios)} |")
    return "\n".join(lines)
