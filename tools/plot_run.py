"""Draw a PNG of loss and throughput against step, with each reconfiguration marked.

    python tools/plot_run.py ckpt/metrics.jsonl --out run.png

Reads the metrics file that pretrain_gpt.py writes (--metrics-file, default
<--save>/metrics.jsonl): its iteration records and elastic reconfigurations; needs matplotlib
(`pip install megadyn[tools]`).
"""

from __future__ import annotations

import argparse
import sys

from megadyn.training.metrics_log import iterations, read_metrics


def parse(path: str):
    records = read_metrics(path)
    by_iteration = iterations(records)
    steps = list(by_iteration)
    losses = [r["losses"]["lm loss"] for r in by_iteration.values()]
    tput = [r["tokens_per_sec"] for r in by_iteration.values()]
    tput = [float("nan") if t is None else t for t in tput]
    events = [
        (r["iteration"], f"{r['old']} -> {r['new']}")
        for r in records
        if r["record"] == "reconfiguration"
    ]
    return steps, losses, tput, events


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", help="metrics file (--metrics-file)")
    p.add_argument("--out", default="run.png")
    a = p.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_run.py needs matplotlib: pip install 'megadyn[tools]'", file=sys.stderr)
        return 2
    steps, losses, tput, events = parse(a.metrics)
    if not steps:
        print(f"{a.metrics}: no iteration records found", file=sys.stderr)
        return 2
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
    ax1.plot(steps, losses, color="tab:blue")
    ax1.set_ylabel("lm loss")
    ax2.plot(steps, tput, color="tab:green")
    ax2.set_ylabel("tokens/s")
    ax2.set_xlabel("iteration")
    for it, label in events:
        for ax in (ax1, ax2):
            ax.axvline(it, color="tab:red", linestyle="--", linewidth=1)
        ax1.annotate(label, (it, max(losses)), rotation=90, fontsize=8, va="top", ha="right")
    fig.tight_layout()
    fig.savefig(a.out, dpi=100)
    print(f"wrote {a.out}: {len(steps)} iterations, {len(events)} reconfigurations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
