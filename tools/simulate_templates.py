"""Simulate the heterogeneous planner against the best homogeneous grid, as a markdown table.

    python tools/simulate_templates.py                    # the table of docs/benchmarks/history/ (issue 23)
    python tools/simulate_templates.py --members 2 8 --layers 24 --gpu-memory-gib 40

For each model and member count N: the best (tp, pp, dp) grid that `LayoutPlanner` finds on
at most N members (the fastest over every count it can use), and the mix of pipeline templates
`HeteroPlanner` picks for N; members used and modelled tokens/s of each, their ratio, and what
`--elastic-layout auto` with templates would run (`templates_win`).
Both come from the same memory and cost models (megadyn/elastic/planning/layouts.py); the grid's
step is the planner's own estimate (which spreads the output layer evenly over the stages and
may interleave), the templates' the per-stage 1F1B model of megadyn/elastic/planning/templates.py.
"""

from __future__ import annotations

import argparse
import time

from megadyn.core.layout import LayoutError
from megadyn.elastic.planning.hetero import HeteroPlanner, best_grid, templates_win
from megadyn.elastic.planning.layouts import LayoutPlanner
from megadyn.models import GPTConfig

MODELS = {  # layers: (hidden, heads): GPT-3 style widths, each too large for one 80 GiB GPU
    24: (4096, 32),
    32: (5120, 40),
    48: (6144, 48),
}


def model(layers: int, hidden: int, heads: int) -> GPTConfig:
    return GPTConfig.gpt2(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        vocab_size=50304,
        max_position_embeddings=2048,
        untie_embeddings_and_output_weights=True,
    )


def grid_name(choice) -> str:
    lay = choice.layout
    vpp = f" vpp{lay.vpp}" if lay.vpp > 1 else ""
    return f"tp{lay.tp} pp{lay.pp} dp{lay.dp}{vpp}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--members", type=int, nargs=2, default=(2, 64), metavar=("FIRST", "LAST"))
    ap.add_argument("--layers", type=int, nargs="+", default=sorted(MODELS))
    ap.add_argument("--step", type=int, default=1, help="every STEP-th member count")
    ap.add_argument("--global-batch-size", type=int, default=128)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--gpu-memory-gib", type=float, default=80.0)
    args = ap.parse_args(argv)
    print(
        f"global batch {args.global_batch_size}, sequence {args.seq_length}, "
        f"{args.gpu_memory_gib:g} GiB per GPU, micro batch 1/2/4, distributed optimizer\n"
    )
    print("| layers | hidden | N | grid | grid used | templates | templates used "
          "| tokens/s grid | tokens/s templates | ratio | auto |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    started = time.time()
    for layers in args.layers:
        hidden, heads = MODELS.get(layers, (4096, 32))
        cfg = model(layers, hidden, heads)
        planner = LayoutPlanner(
            cfg,
            global_batch_size=args.global_batch_size,
            seq_length=args.seq_length,
            gpu_memory_gib=args.gpu_memory_gib,
        )
        hetero = HeteroPlanner(planner)
        tokens = args.global_batch_size * args.seq_length
        for n in range(args.members[0], args.members[1] + 1, args.step):
            grid = best_grid(planner, n)
            try:
                plan = hetero.plan(n)
            except LayoutError:
                plan = None
            g_used = grid.layout.world_size if grid else 0
            t_used = plan.members_used if plan else 0
            g_tps = tokens / grid.step_seconds if grid else 0.0
            t_tps = tokens / plan.step_seconds if plan else 0.0
            ratio = f"{t_tps / g_tps:.2f}" if grid and plan else "-"
            print(
                f"| {layers} | {hidden} | {n} | {grid_name(grid) if grid else '-'} "
                f"| {g_used / n:.0%} | {plan.describe() if plan else '-'} | {t_used / n:.0%} "
                f"| {g_tps:,.0f} | {t_tps:,.0f} | {ratio} "
                f"| {'templates' if templates_win(grid, plan) else 'grid'} |"
            )
    print(f"\n({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
