"""Time live layout changes against the checkpoint path, on GPUs (one JSON line per change).

    torchrun --nproc-per-node 4 tools/bench_reshard.py --changes dp4 tp2xdp2 tp2xpp2 --ckpt-dir /tmp/ck

Trains the 1.42 B reference model (bf16, distributed optimizer, mock data) under tp2 x pp2, then
for each change: saves a torch.distributed.checkpoint of the whole training state (timed), changes
the layout live through the elastic controller (timed by phase), runs a step under the new layout,
and loads the checkpoint into the new layout (timed), so that live and checkpoint paths are
measured on the same state and cards. Also measures point-to-point bandwidth between two GPUs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

import torch
import torch.distributed as dist

from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.elastic.controller import ElasticController, reconfiguration
from megadyn.launch.distributed_init import init_distributed
from megadyn.training import checkpoint as ckpt
from megadyn.training.arguments import parse_args
from megadyn.training.trainer import Trainer

MODEL = (
    "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 "
    "--seq-length 2048 --max-position-embeddings 2048 --untie-embeddings-and-output-weights "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 50303 --micro-batch-size 2 "
    "--global-batch-size 16 --bf16 --use-distributed-optimizer --lr 1e-4 --train-iters 100 "
    "--eval-interval 0 --num-workers 0 --hidden-dropout 0 --attention-dropout 0 "
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"
).split()


def layout_of(name: str, world: int) -> Layout:
    tp = pp = 1
    for part in name.split("x"):
        if part.startswith("tp"):
            tp = int(part[2:])
        elif part.startswith("pp"):
            pp = int(part[2:])
    return Layout.from_world(world, tp, pp)


def p2p_bandwidth(device, nbytes=1 << 30) -> float:
    """GB/s of one send from rank 0 to rank 1 (the last of four)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rank = dist.get_rank()
    for _ in range(4):
        _sync()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
        _sync()
        elapsed = time.perf_counter() - t0
    return nbytes / elapsed / 1e9


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()


def timed(fn, *args, **kwargs):
    _sync()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    _sync()
    return out, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--changes", nargs="+", default=["dp4", "tp2xdp2", "tp2xpp2"])
    p.add_argument("--ckpt-dir", default="/tmp/megadyn_reshard_ckpt")
    p.add_argument("--tiny", action="store_true", help="a tiny model (a CPU smoke run)")
    a = p.parse_args()
    device = init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    flags = MODEL
    if a.tiny:
        flags = MODEL[:]
        for flag, value in (
            ("--num-layers", "4"),
            ("--hidden-size", "64"),
            ("--ffn-hidden-size", "256"),
            ("--seq-length", "32"),
            ("--max-position-embeddings", "32"),
            ("--num-attention-heads", "4"),
            ("--vocab-size", "1023"),
        ):
            flags[flags.index(flag) + 1] = value
        flags.remove("--bf16")
    cfg = parse_args(flags, world)
    dist.barrier()  # as launch.run does: the world communicator exists before a change
    groups = ParallelGroups.build(cfg.layout(world), range(world))
    trainer = Trainer(cfg, groups, device, print_fn=lambda *x, **k: None)
    for _ in range(2):
        trainer.train_step()
    controller = ElasticController(cfg, None, device, print_fn=lambda *x, **k: None)
    bw = p2p_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 24))
    for i, name in enumerate(a.changes):
        old = trainer.groups.layout
        path = f"{a.ckpt_dir}/change{i}"
        it = trainer.state.iteration
        _, save_s = timed(
            ckpt.save_checkpoint,
            path,
            it,
            trainer.chunks,
            trainer.optimizer,
            trainer.groups,
            {"state": {}},
        )
        new = layout_of(name, world)
        rec = reconfiguration(trainer, controller.epoch + 1, new, list(range(world)), [])
        trainer, live_s = timed(controller.apply, rec, trainer)
        _, step_s = timed(trainer.train_step)
        _, load_s = timed(
            ckpt.load_checkpoint,
            path,
            trainer.chunks,
            trainer.optimizer,
            trainer.groups,
            load_rng=False,
        )
        event = controller.events[-1]
        if rank == 0:
            print(
                json.dumps(
                    {
                        "change": f"{event['old']} -> {event['new']}",
                        "live_s": round(live_s, 3),
                        "plan_s": event["plan_s"],
                        "reshard_s": event["reshard_s"],
                        "rebuild_s": event["rebuild_s"],
                        "bytes_moved_gb": round(event["bytes_moved"] / 1e9, 2),
                        "max_rank_send_gb": round(event["max_rank_send_bytes"] / 1e9, 2),
                        "first_step_s": round(step_s, 3),
                        "dcp_save_s": round(save_s, 2),
                        "dcp_load_s": round(load_s, 2),
                        "ckpt_over_live": round((save_s + load_s) / live_s, 1),
                        "p2p_gb_s": round(bw, 1),
                        "old": str(old),
                    }
                ),
                flush=True,
            )
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
    trainer.groups.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
