"""Draw a PNG of loss and throughput against step, with each reconfiguration marked.

    python tools/plot_run.py train.log --out run.png

Reads megadyn's log (the iteration lines and the ` elastic:` lines that pretrain_gpt.py prints);
needs matplotlib (`pip install megadyn[tools]`).
"""

from __future__ import annotations

import argparse
import re
import sys

ITERATION = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|(?:.*?tokens/s: ([0-9.]+) \|)?"
)
ELASTIC = re.compile(
    r"elastic: event: (\w+) \| epoch: \d+ \| iteration: (\d+) \| old: (\S+) \| new: (\S+)"
)


def parse(path: str):
    steps, losses, tput, events = [], [], [], []
    with open(path, errors="replace") as f:
        for line in f:
            if m := ITERATION.search(line):
                steps.append(int(m.group(1)))
                losses.append(float(m.group(2)))
                tput.append(float(m.group(3)) if m.group(3) else float("nan"))
            elif m := ELASTIC.search(line):
                events.append((int(m.group(2)), f"{m.group(3)} -> {m.group(4)}"))
    return steps, losses, tput, events


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log")
    p.add_argument("--out", default="run.png")
    a = p.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_run.py needs matplotlib: pip install 'megadyn[tools]'", file=sys.stderr)
        return 2
    steps, losses, tput, events = parse(a.log)
    if not steps:
        print(f"{a.log}: no iteration lines found", file=sys.stderr)
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
