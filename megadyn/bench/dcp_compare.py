"""Dynamic against static context parallelism on document-masked samples, in one process per
rank (tools/bench_dcp_compare.py; scripts/gpu/dcp_compare.sh runs it on 2 GPUs).

    torchrun --nproc-per-node 2 tools/bench_dcp_compare.py --out dcp.jsonl --seq 32768
    python3 tools/bench_dcp_compare.py --summarize dcp.jsonl          # markdown tables

Samples are packed documents of log-normal lengths (`--documents MEDIAN:SIGMA`, default
1024:1.6: median 1k tokens, a few as long as the sample; megadyn/bench/documents.py), the same
on every rank. Two parts, each record appended to `--out`:

- attention: one layer's attention of the reference model's shape (`--heads`, `--head-dim`),
  forward and backward, per sample and row: `ring` (--cp-placement static: the ring, whose
  document-masked blocks run the fused kernel once per document), `static_blocks` (the static
  split through dynamic cp's call), `dynamic` (the balanced placement; on the GPU one
  flex_attention call over the gathered keys, flex.py), `dynamic_varlen` (the same placement
  through dynamic.py's two varlen flash calls, --attention-backend flash) and `a2a`
  (--cp-comm-type a2a: half the heads over the whole sequence, its document mask in one
  flex_attention call, every rank's work equal by construction). The same
  sample repeats, so the ring's per-shape kernel plans are built once here; in e2e every micro
  batch brings new shapes. Each record has the
  median time (the slowest rank's), every rank's attention work (visible query/key pairs) and
  its imbalance (largest distance from the mean), and the key/value blocks each rank received
  (in units of its own: the ring's is cp - 1; a2a's (cp - 1) / cp, with as much of its
  queries and output).
- e2e: training steps of the reference GPT (megadyn/bench/gpt.py's flags after ours) at
  `--seq` with each of `--e2e-rows` placements: tokens/s per GPU.

A run that would end after `--budget-s` is skipped and recorded as such; one that runs out of
memory is recorded as `oom` (and, in e2e, ends the runs, as in cp_compare.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from megadyn.bench.cp_compare import guarded
from megadyn.bench.documents import document_lengths, skewed_document_ids
from megadyn.bench.gpt import parse_args, run_gpt_bench
from megadyn.core.context_parallel import (
    dynamic_attention,
    gather_heads,
    kernel_for_backend,
    ring_attention,
    scatter_heads,
)
from megadyn.core.context_parallel.placement import imbalance, place_blocks, static_work
from megadyn.models.document_attention import DocumentMask, document_attention

ATTENTION_ROWS = ("dynamic", "dynamic_varlen", "static_blocks", "a2a", "ring")
"""In running order: the ring, which may run out of memory at 32k, last."""


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON lines, one record per run (appended)")
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--documents", default="1024:1.6", metavar="MEDIAN:SIGMA")
    p.add_argument("--block", type=int, default=1024, help="--cp-block-size")
    p.add_argument("--samples", type=int, default=3, help="samples of the attention part")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rows", nargs="+", default=list(ATTENTION_ROWS), choices=ATTENTION_ROWS)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(  # the ring (static), which may run out of memory at 32k, last
        "--e2e-rows", nargs="*", default=["dynamic", "static_blocks", "a2a", "static"]
    )
    p.add_argument("--e2e-iters", type=int, default=3)
    p.add_argument("--e2e-warmup", type=int, default=1)
    p.add_argument("--tokens", type=int, default=65536, help="tokens per e2e iteration")
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="full")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip runs that would end later")
    p.add_argument("--summarize", help="print the markdown tables of this JSON-lines file")
    c, c.model_flags = p.parse_known_args(argv)  # the rest: gpt.py's flags (--layers, ...)
    return c


def sample_ids(c: argparse.Namespace, index: int) -> torch.Tensor:
    """[1, S] document ids of attention sample `index` (the same on every rank)."""
    median, sigma = (float(x) for x in c.documents.split(":"))
    gen = torch.Generator().manual_seed(1000 + index)
    return skewed_document_ids(c.seq, gen, median, sigma)[None]


def _attention_fn(row: str, ids: torch.Tensor, c, group, device):
    """(attention(q, k, v), work per rank, key/value blocks received per rank) of `row`."""
    cp = dist.get_world_size(group)
    ids_dev = ids.to(device)
    if row == "ring":
        work = static_work(c.seq, cp, ids)
        kernel = kernel_for_backend("auto")
        return (
            lambda q, k, v: ring_attention(q, k, v, group, None, ids_dev, kernel),
            work,
            [cp - 1] * cp,  # in units of the rank's own keys and values
        )
    if row == "a2a":
        mask = DocumentMask.build(ids_dev)  # the whole sequence's, as without cp

        def a2a(q, k, v):
            return gather_heads(document_attention(*scatter_heads([q, k, v], group), mask), group)

        equal = sum(static_work(c.seq, cp, ids)) / cp
        return a2a, [equal] * cp, [(cp - 1) / cp] * cp
    placement = place_blocks(c.seq, c.block, cp, ids, balance=row != "static_blocks")
    kernel = "flash" if row == "dynamic_varlen" else None
    received = []
    for r in range(cp):
        own = set(placement.blocks[r])
        needed = {k for _, k in placement.pairs(r) if k not in own}
        received.append(len(needed) / len(own))
    return (
        lambda q, k, v: dynamic_attention(q, k, v, group, placement, kernel=kernel),
        list(placement.work),
        received,
    )


def time_attention(fn, c, device) -> dict:
    """{"seconds": median seconds of forward + backward of `fn`} on this rank's random q, k,
    v."""
    cp = dist.get_world_size()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = (1, c.heads, c.seq // cp, c.head_dim)  # [b, n, s/cp, d]
    q, k, v = (torch.randn(shape, dtype=dtype, device=device, requires_grad=True) for _ in "qkv")
    grad = torch.randn(shape, dtype=dtype, device=device)
    times = []
    for i in range(c.warmup + c.iters):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn(q, k, v).backward(grad)
        _sync(device)
        if i >= c.warmup:
            times.append(time.perf_counter() - t0)
    return dict(seconds=statistics.median(times))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def attention_records(c, device, emit, left) -> None:
    """Each row over every sample (a row out of memory skips its other samples)."""
    group = dist.group.WORLD
    for row in c.rows:
        failed = None
        for index in range(c.samples):
            ids = sample_ids(c, index)
            lengths = document_lengths(ids[0])
            rec = dict(part="attention", sample=index, row=row, seq=c.seq, block=c.block)
            rec.update(documents=len(lengths), longest=max(lengths))
            fn, work, received = _attention_fn(row, ids, c, group, device)
            rec.update(work=work, imbalance=round(imbalance(work), 4), kv_received=received)
            if failed or left() <= 0:
                emit(dict(rec, skipped=failed or "budget"))
                continue
            result = guarded(device, time_attention, fn, c, device)
            if "seconds" in result:  # the slowest rank's median
                t = torch.tensor([result.pop("seconds")], device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                result["ms"] = round(t.item() * 1e3, 3)
            elif result.get("oom"):
                failed = "oom before"
            emit(dict(rec, **result))


def e2e_records(c, device, emit, left) -> None:
    for row in c.e2e_rows:
        rec = dict(part="e2e", row=row, seq=c.seq, block=c.block, documents=c.documents)
        if left() <= 0:
            emit(dict(rec, skipped="budget"))
            continue
        flags = c.model_flags + ["--cp", str(dist.get_world_size()), "--seq", str(c.seq)]
        flags += ["--mbs", "1", "--gbs", str(max(1, c.tokens // c.seq))]
        flags += ["--iters", str(c.e2e_iters), "--warmup", str(c.e2e_warmup)]
        flags += ["--recompute", c.recompute, "--documents", c.documents]
        if row == "a2a":
            flags += ["--cp-comm-type", "a2a"]
        else:
            flags += ["--cp-placement", row, "--cp-block-size", str(c.block)]
        a = parse_args(flags)
        result = guarded(device, run_gpt_bench, a, device)
        emit(dict(rec, **result))
        if result.get("oom"):
            return  # what the failed run left behind would spoil the runs after it


def main(c: argparse.Namespace, device) -> None:
    start = time.perf_counter()

    def left() -> float:
        flag = [c.budget_s - (time.perf_counter() - start)]
        dist.broadcast_object_list(flag, src=0)  # every rank skips the same runs
        return flag[0]

    def emit(rec: dict) -> None:
        if dist.get_rank() == 0:
            print(json.dumps(rec), flush=True)
            if c.out:
                with open(c.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")

    attention_records(c, device, emit, left)
    e2e_records(c, device, emit, left)


def summarize(path: str) -> str:
    """Markdown: the attention times and work imbalance per sample and row, dynamic's speedup
    over the others per sample (and the median), then the e2e tokens/s per GPU."""
    recs = [json.loads(line) for line in open(path) if line.strip()]
    att = [r for r in recs if r["part"] == "attention"]
    att.sort(key=lambda r: (r["sample"], ATTENTION_ROWS.index(r["row"])))
    lines = [
        "| sample | docs | longest | row | attention ms (fwd+bwd) | work per rank (M pairs) "
        "| work imbalance | kv received |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in att:
        ms = r.get("ms", "oom" if r.get("oom") else r.get("skipped", r.get("error", "-")))
        kv = " ".join(f"{x:.2f}" for x in r["kv_received"])
        work = " ".join(f"{w / 1e6:.1f}" for w in r["work"])
        lines.append(
            f"| {r['sample']} | {r['documents']} | {r['longest']} | {r['row']} | {ms} | {work} "
            f"| {r['imbalance']:.1%} | {kv} |"
        )
    ms = {(r["sample"], r["row"]): r.get("ms") for r in att}
    lines += [
        "",
        "| sample | ring / dynamic | static_blocks / dynamic | a2a / dynamic "
        "| dynamic_varlen / dynamic |",
        "|---|---|---|---|---|",
    ]
    ratios: dict[str, list[float]] = {
        "ring": [],
        "static_blocks": [],
        "a2a": [],
        "dynamic_varlen": [],
    }
    for sample in sorted({r["sample"] for r in att}):
        cells = []
        for other in ratios:
            a, b = ms.get((sample, other)), ms.get((sample, "dynamic"))
            if a and b:
                ratios[other].append(a / b)
            cells.append(f"{a / b:.3f}" if a and b else "-")
        lines.append(f"| {sample} | {' | '.join(cells)} |")
    medians = [f"{statistics.median(v):.3f}" if v else "-" for v in ratios.values()]
    lines.append(f"| median | {' | '.join(medians)} |")
    lines += ["", "| e2e row | tokens/s/GPU | iteration s | peak GiB |", "|---|---|---|---|"]
    for r in (r for r in recs if r["part"] == "e2e"):
        tps = r.get("tokens_per_s_per_gpu")
        why = "oom" if r.get("oom") else r.get("skipped", r.get("error", "-"))
        shown = f"{tps:,.0f}" if tps else why
        lines.append(
            f"| {r['row']} | {shown} | {r.get('iter_s', '-')} | {r.get('peak_mem_gib', '-')} |"
        )
    return "\n".join(lines)
