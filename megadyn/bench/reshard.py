"""Time live layout changes against the checkpoint path (tools/bench_reshard.py).

    device = init_distributed()
    run_reshard_bench(["dp4", "tp2xdp2"], "/tmp/ck", device, report=print_json)

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
from typing import Callable

import torch
import torch.distributed as dist

from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.elastic.control.controller import ElasticController
from megadyn.elastic.control.records import reconfiguration
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
    """The layout named like "tp2xpp2" or "cp2xdp2" over `world` ranks (dp fills the rest)."""
    degrees = {"tp": 1, "cp": 1, "pp": 1}
    for part in name.split("x"):
        if part[:2] in degrees:
            degrees[part[:2]] = int(part[2:])
    return Layout.from_world(world, degrees["tp"], degrees["pp"], cp=degrees["cp"])


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


def model_flags(tiny: bool) -> list[str]:
    """The reference model's command line; with `tiny`, a tiny fp32 model (a CPU smoke run)."""
    if not tiny:
        return MODEL
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
    return flags


def run_reshard_bench(
    changes: list[str], ckpt_dir: str, device, *, tiny: bool = False, report: Callable[[dict], None]
) -> None:
    """Train two steps under tp2 x pp2, then make each of `changes` (layout names such as
    "tp2xdp2") live and through a checkpoint; rank 0 calls `report` with each change's record."""
    world = dist.get_world_size()
    cfg = parse_args(model_flags(tiny), world)
    dist.barrier()  # as run_elastic does at launch: the world communicator exists before a change
    groups = ParallelGroups.build(cfg.layout(world), range(world))
    trainer = Trainer(cfg, groups, device, print_fn=lambda *x, **k: None)
    for _ in range(2):
        trainer.train_step()
    controller = ElasticController(cfg, None, device, print_fn=lambda *x, **k: None)
    bw = p2p_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 24))
    for i, name in enumerate(changes):
        path = f"{ckpt_dir}/change{i}"
        trainer, record = _change(trainer, controller, layout_of(name, world), path, bw)
        if dist.get_rank() == 0:
            report(record)
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
    trainer.groups.destroy()


def _change(trainer, controller, new: Layout, path: str, p2p_bandwidth: float):
    """Save a checkpoint, change to `new` live, take a step, load the checkpoint under `new`:
    the trainer of the new layout and the change's record."""
    old = trainer.groups.layout
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
    world = dist.get_world_size()
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
    event = controller.events[-1].to_dict()
    return trainer, {
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
        "p2p_gb_s": round(p2p_bandwidth, 1),
        "old": str(old),
    }


def main(argv=None) -> None:
    """tools/bench_reshard.py (python -m megadyn.bench reshard): one JSON line per change."""
    p = argparse.ArgumentParser(description="Time live layout changes against the checkpoint path.")
    p.add_argument("--changes", nargs="+", default=["dp4", "tp2xdp2", "cp2xdp2", "tp2xpp2"])
    p.add_argument("--ckpt-dir", default="/tmp/megadyn_reshard_ckpt")
    p.add_argument("--tiny", action="store_true", help="a tiny model (a CPU smoke run)")
    a = p.parse_args(argv)
    device = init_distributed()
    run_reshard_bench(
        a.changes,
        a.ckpt_dir,
        device,
        tiny=a.tiny,
        report=lambda record: print(json.dumps(record), flush=True),
    )
    dist.destroy_process_group()
