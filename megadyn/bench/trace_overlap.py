"""How much of a step's communication the GPU hides behind compute, from a torch.profiler trace.

Reads the Chrome trace that torch.profiler exports (`prof.export_chrome_trace`) and sorts the
GPU's work into transfers (NCCL kernels, and memory copies: the copy engines) and compute
(every other kernel), then measures on one device's timeline, in milliseconds:

    window           first start to last end
    busy             time any kernel or copy runs
    compute          time a compute kernel runs
    comm             time a transfer runs
    exposed_comm     time a transfer runs and no compute kernel does
    idle             window - busy (host-bound gaps, launch latency)
    gemm_sum         summed durations of GEMM kernels (slowed GEMMs show here)
    transfers        per transfer name: [count, summed duration, exposed duration]

    figures = summarize(json.load(open("trace.json")), steps=2)   # per step
    python3 tools/trace_overlap.py TRACE.json [--steps N]         # the same, printed as JSON
"""

from __future__ import annotations

import argparse
import json

_GEMM_MARKS = ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the union `a` not covered by the union `b` (both sorted, disjoint)."""
    total, j = 0.0, 0
    for start, end in a:
        cursor = start
        while j < len(b) and b[j][1] <= cursor:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                total += b[k][0] - cursor
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            total += end - cursor
    return total


def kernels(trace: dict) -> list[dict]:
    """The GPU kernel and memory-copy events of the first device in the trace."""
    events = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e
    ]
    if not events:
        raise ValueError("the trace has no GPU kernel events (profiled without CUDA?)")
    first = min(e["pid"] for e in events)
    return [e for e in events if e["pid"] == first]


def _is_transfer(e: dict) -> bool:
    return e.get("cat") == "gpu_memcpy" or "nccl" in e["name"].lower()


def summarize(trace: dict, steps: int = 1) -> dict:
    """The figures of the module docstring, per step, from a Chrome trace dict."""
    comm, compute, gemm_sum = [], [], 0.0
    events = kernels(trace)
    for e in events:
        interval = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        (comm if _is_transfer(e) else compute).append(interval)
        if any(mark in e["name"].lower() for mark in _GEMM_MARKS):
            gemm_sum += float(e["dur"])
    comm_u, compute_u = _union(comm), _union(compute)
    transfers: dict[str, list[float]] = {}  # name -> [count, duration, exposed]
    for e in filter(_is_transfer, events):
        start, dur = float(e["ts"]), float(e["dur"])
        row = transfers.setdefault(e["name"][:60], [0, 0.0, 0.0])
        row[0] += 1
        row[1] += dur
        row[2] += _minus([(start, start + dur)], compute_u)
    busy = _union(comm + compute)
    window = busy[-1][1] - busy[0][0]
    per_step_ms = 1.0 / (1000.0 * steps)  # trace times are microseconds
    figures = dict(
        window=window,
        busy=_length(busy),
        compute=_length(compute_u),
        comm=_length(comm_u),
        exposed_comm=_minus(comm_u, compute_u),
        idle=window - _length(busy),
        gemm_sum=gemm_sum,
    )
    out = {k: round(v * per_step_ms, 4) for k, v in figures.items()}
    out["kernels"] = len(events)
    out["transfers"] = {
        k: [c / steps, round(t * per_step_ms, 4), round(x * per_step_ms, 4)]
        for k, (c, t, x) in sorted(transfers.items())
    }
    return out


def write_kernels_csv(trace: dict, path: str) -> None:
    """The kernel timeline (start us, duration us, stream, name) as gzipped CSV, for a closer
    look at a few layers than the summary gives."""
    import csv
    import gzip

    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["ts", "dur", "stream", "name"])
        for e in sorted(kernels(trace), key=lambda e: e["ts"]):
            w.writerow([e["ts"], e["dur"], e.get("tid"), e["name"][:80]])


def main(argv=None) -> None:
    """tools/trace_overlap.py TRACE.json [--steps N]: the figures of `summarize` as one JSON line."""
    p = argparse.ArgumentParser(
        description="How much of a step's communication ran beside compute."
    )
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=1)
    a = p.parse_args(argv)
    with open(a.trace) as f:
        print(json.dumps(summarize(json.load(f), a.steps)))
