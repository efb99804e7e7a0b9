"""The heterogeneous step's overhead: a grid against the same grid run as replicas, A/B.

    torchrun --nproc-per-node 4 tools/bench_hetero_step.py --pp 2 --steps 30
    torchrun --nproc-per-node 2 tools/bench_hetero_step.py --pp 1

One job builds both over the same processes: the (tp 1, pp, dp) grid (`ParallelGroups`, DDP's
bucketed data-parallel reduction and the embedding sum) and the same replicas as a
`HeteroLayout` (`HeteroLayout.from_grid`: per-layer-range reduce groups, `reduce_hetero_grads`,
each replica's share of the micro batches). Steps alternate between the two (forward, backward,
reductions, optimizer step; a barrier on either side), so both see the same machine; rank 0
prints one JSON line with the median step seconds of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megadyn.core.distributed import finalize_model_grads  # noqa: E402
from megadyn.core.groups import ParallelGroups  # noqa: E402
from megadyn.core.hetero_groups import HeteroGroups, reduce_hetero_grads  # noqa: E402
from megadyn.core.hetero_layout import HeteroLayout  # noqa: E402
from megadyn.core.layout import Layout  # noqa: E402
from megadyn.core.optimizer import OptimizerConfig  # noqa: E402
from megadyn.core.pipeline import forward_backward  # noqa: E402
from megadyn.models import GPTConfig, lm_loss_for  # noqa: E402
from megadyn.training.build import build_model_parts, no_sync  # noqa: E402
from megadyn.training.config import MegadynConfig, TrainingConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=30, help="timed steps of each, after 3 warm-up")
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) if cuda else 0)
    if not cuda:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    model = GPTConfig.gpt2(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=4,
        vocab_size=1000,
        max_position_embeddings=a.seq,
    )
    mbs, gbs = a.micro_batch_size, a.global_batch_size
    cfg = MegadynConfig(
        model=model,
        training=TrainingConfig(micro_batch_size=mbs, global_batch_size=gbs),
        optimizer=OptimizerConfig(lr=1e-4, clip_grad=1.0),
    )
    layout = Layout.from_world(world, 1, a.pp)
    micro = gbs // mbs // layout.dp
    grid = ParallelGroups.build(layout, range(world))
    hetero = HeteroGroups.build(HeteroLayout.from_grid(layout, range(world), a.layers, micro))
    parts = {
        "grid": build_model_parts(cfg, model, grid, device),
        "replicas": build_model_parts(cfg, model, hetero, device),
    }
    g = torch.Generator().manual_seed(0)
    batch = {
        "tokens": torch.randint(0, 1000, (mbs, a.seq), generator=g).to(device),
        "labels": torch.randint(0, 1000, (mbs, a.seq), generator=g).to(device),
        "loss_mask": torch.ones(mbs, a.seq, device=device),
        "position_ids": torch.arange(a.seq, device=device).expand(mbs, a.seq),
    }
    loss_fn = lm_loss_for(None)

    def step(kind: str) -> float:
        m, groups = parts[kind], grid if kind == "grid" else hetero.replica
        dist.barrier()
        t0 = time.perf_counter()
        m.optimizer.zero_grad()
        for d in m.ddp:
            d.zero_grad_buffer()
        forward_backward(
            m.ddp,
            groups,
            iter([batch] * micro),
            micro,
            config=m.pipeline_cfg,
            loss_fn=loss_fn,
            no_sync=lambda: no_sync(m.ddp),
            loss_scale=1.0 if kind == "grid" else hetero.batch_share,
        )
        if kind == "grid":
            finalize_model_grads(m.ddp, grid)
        else:
            reduce_hetero_grads(m.ddp, hetero)
        m.optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"grid": [], "replicas": []}
    for i in range(3 + a.steps):
        for kind in ("grid", "replicas") if i % 2 else ("replicas", "grid"):
            t = step(kind)
            if i >= 3:
                times[kind].append(t)
    if dist.get_rank() == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            json.dumps(
                {
                    "layout": f"tp1xpp{layout.pp}xdp{layout.dp}",
                    "device": device.type,
                    "grid_step_s": round(med["grid"], 5),
                    "replicas_step_s": round(med["replicas"], 5),
                    "replicas_over_grid": round(med["replicas"] / med["grid"], 3),
                    "steps": a.steps,
                }
            ),
            flush=True,
        )
    hetero.destroy()
    grid.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
