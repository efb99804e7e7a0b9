"""Time replicas of different pipeline depth against grids: tokens/s per process used.

    python tools/bench_hetero.py --out DIR --iters 20 \
        "grid pp3|3|--pipeline-model-parallel-size 3" \
        "templates 2+1|3|--heterogeneous-pipelines 2 1" \
        "4 -> 2+1 live|4|--pipeline-model-parallel-size 2 --heterogeneous-pipelines|2 1" \
        -- MODEL FLAGS (pretrain_gpt.py's)

Each run is `torchrun --standalone --nproc-per-node N pretrain_gpt.py MODEL FLAGS RUN FLAGS`
with --log-interval 1 and a metrics file in DIR; a run with a fourth field changes its layout
live to replicas of those stage counts (`tools/elastic_ctl.py layout --pipelines ...`) after
--change-at iterations. Per run (and per layout of a live run) it prints a JSON record: the
median seconds per iteration and tokens/s over the iterations after --skip warm-up ones (and
after the first step of a new layout), tokens/s per process used, and the change's seconds.
DIR/hetero.md gets the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys

from megadyn.training.metrics_log import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The repository: pretrain_gpt.py and tools/elastic_ctl.py are run from here."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name: str, nproc: int, flags: list[str], change: list[str], a, model: list[str]) -> list:
    metrics = os.path.join(a.out, name.replace(" ", "_").replace("/", "") + ".jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(nproc), os.path.join(ROOT, "pretrain_gpt.py"), *model, *flags]
    cmd += ["--train-iters", str(a.iters), "--log-interval", "1", "--metrics-file", metrics]
    tool = None
    if change:
        port = free_port()
        cmd += ["--elastic-control-port", str(port)]
        ctl = [sys.executable, os.path.join(ROOT, "tools/elastic_ctl.py"), "--port", str(port)]
        ctl += ["--timeout", "300", "layout", "--pipelines", *change]
        ctl += ["--at-iteration", str(a.change_at)]
        tool = subprocess.Popen(ctl, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = os.path.join(a.out, "logs", name.replace(" ", "_") + ".log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=a.timeout).returncode
    if tool is not None:
        tool.wait(timeout=30)
    records = read_metrics(metrics) if os.path.exists(metrics) else []
    if rc != 0 or not records:
        return [{"run": name, "error": f"exit {rc}, see {log}"}]
    return summarize(name, nproc, records, a)


def processes_of(layout: str) -> int:
    """Processes of a layout as the events name it: tp2xpp2xdp1, tp1x[pp2+pp1]."""
    tp = int(re.match(r"tp(\d+)", layout).group(1))
    if "[" in layout:
        return tp * sum(int(s) for s in re.findall(r"pp(\d+)", layout))
    degrees = [int(d) for d in re.findall(r"x(?:cp|pp|dp)(\d+)", layout)]
    return tp * math.prod(degrees)


def summarize(name: str, nproc: int, records: list[dict], a) -> list[dict]:
    """One record per layout of the run: median step time and tokens/s after warm-up."""
    events = [r for r in records if r["record"] == "reconfiguration"]
    its = [r for r in records if r["record"] == "iteration"]
    spans = [(a.skip, events[0]["iteration"] if events else a.iters, nproc, "start")]
    if events:
        e = events[0]
        spans.append((e["iteration"] + 1, a.iters, processes_of(e["new"]), e["new"]))
    out = []
    for first, last, members, layout in spans:
        window = [r for r in its if first < r["iteration"] <= last]
        if not window:
            continue
        tok = statistics.median(r["tokens_per_sec"] for r in window)
        row = {
            "run": name,
            "layout": layout,
            "processes": members,
            "iterations": len(window),
            "step_s": round(statistics.median(r["elapsed_ms"] for r in window) / 1e3, 4),
            "tokens_per_s": round(tok),
            "tokens_per_s_per_process": round(tok / members),
        }
        if layout != "start":
            row["change_s"] = events[0]["total_s"]
            first_after = [r for r in its if r["iteration"] == events[0]["iteration"] + 1]
            row["first_step_after_s"] = (
                round(first_after[0]["elapsed_ms"] / 1e3, 3) if first_after else None
            )
        out.append(row)
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| run | layout | processes | s / iteration | tokens/s | tokens/s per process "
        "| change (s) | first step after (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} | failed: {r['error']} |||||||")
            continue
        lines.append(
            f"| {r['run']} | {r['layout']} | {r['processes']} | {r['step_s']} "
            f"| {r['tokens_per_s']} | {r['tokens_per_s_per_process']} "
            f"| {r.get('change_s', '')} | {r.get('first_step_after_s', '')} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    model = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--skip", type=int, default=3, help="warm-up iterations left out")
    p.add_argument("--change-at", type=int, default=10, help="iteration of a live change")
    p.add_argument("--rounds", type=int, default=1, help="every run again, in turn")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("runs", nargs="+", help="NAME|NPROC|FLAGS[|STAGES of a live change]")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for round_ in range(a.rounds):
        for spec in a.runs:
            name, nproc, flags, *change = spec.split("|")
            label = f"{name} (round {round_ + 1})" if a.rounds > 1 else name
            stages = change[0].split() if change else []
            for row in run(label, int(nproc), flags.split(), stages, a, model):
                print(json.dumps(row), flush=True)
                rows.append(row)
    with open(os.path.join(a.out, "hetero.md"), "w") as f:
        f.write(table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
