"""The heterogeneous step's overhead: a grid against the same grid run as replicas, A/B.

    torchrun --nproc-per-node 4 tools/bench_hetero_step.py --pp 2 --steps 30
    torchrun --nproc-per-node 2 tools/bench_hetero_step.py --pp 1

One job builds both over the same processes, each as the `Trainer` that pretrain_gpt.py runs
(on synthetic tokens): the (tp 1, pp, dp) grid (`ParallelGroups`, DDP's bucketed data-parallel
reduction and the embedding sum) and the same replicas as a `HeteroLayout`
(`HeteroLayout.from_grid`: per-layer-range reduce groups, `reduce_hetero_grads`, each replica's
share of the micro batches). Steps (`Trainer.train_step`: forward, backward, reductions,
optimizer step; a barrier on either side) alternate between the two, so both see the same
machine; rank 0 prints one JSON line with the median step seconds of each and their ratio.
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

from megadyn.core.groups import ParallelGroups  # noqa: E402
from megadyn.core.hetero_groups import HeteroGroups  # noqa: E402
from megadyn.core.hetero_layout import HeteroLayout  # noqa: E402
from megadyn.core.layout import Layout  # noqa: E402
from megadyn.core.optimizer import OptimizerConfig  # noqa: E402
from megadyn.models import GPTConfig  # noqa: E402
from megadyn.training.config import DataConfig, MegadynConfig, TrainingConfig  # noqa: E402
from megadyn.training.trainer import Trainer  # noqa: E402


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
        data=DataConfig(seq_length=a.seq, vocab_size=999, mock_data=True, num_workers=0),
        training=TrainingConfig(
            micro_batch_size=mbs, global_batch_size=gbs, train_iters=3 + a.steps, eval_iters=0
        ),
        optimizer=OptimizerConfig(lr=1e-4, clip_grad=1.0),
    )
    layout = Layout.from_world(world, 1, a.pp)
    micro = gbs // mbs // layout.dp
    grid = ParallelGroups.build(layout, range(world))
    hetero = HeteroGroups.build(HeteroLayout.from_grid(layout, range(world), a.layers, micro))

    def quiet(*_, **__) -> None:  # the trainers' lines
        pass

    trainers = {
        "grid": Trainer(cfg, grid, device, print_fn=quiet),
        "replicas": Trainer(cfg, hetero, device, print_fn=quiet),
    }

    def step(kind: str) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        trainers[kind].train_step()
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
    for trainer in trainers.values():
        trainer.release()
    hetero.destroy()
    grid.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
