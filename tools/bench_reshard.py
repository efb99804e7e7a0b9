"""Time live layout changes against the checkpoint path, on GPUs (one JSON line per change).

    torchrun --nproc-per-node 4 tools/bench_reshard.py --changes dp4 tp2xdp2 cp2xdp2 tp2xpp2 --ckpt-dir /tmp/ck

Trains the 1.42 B reference model (bf16, distributed optimizer, mock data) under tp2 x pp2, then
for each change: saves a torch.distributed.checkpoint of the whole training state (timed), changes
the layout live through the elastic controller (timed by phase), runs a step under the new layout,
and loads the checkpoint into the new layout (timed), so that live and checkpoint paths are
measured on the same state and cards. Also measures point-to-point bandwidth between two GPUs
(megadyn/bench/reshard.py).
"""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist

from megadyn.bench.reshard import run_reshard_bench
from megadyn.launch.distributed_init import init_distributed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--changes", nargs="+", default=["dp4", "tp2xdp2", "cp2xdp2", "tp2xpp2"])
    p.add_argument("--ckpt-dir", default="/tmp/megadyn_reshard_ckpt")
    p.add_argument("--tiny", action="store_true", help="a tiny model (a CPU smoke run)")
    a = p.parse_args()
    device = init_distributed()
    run_reshard_bench(
        a.changes,
        a.ckpt_dir,
        device,
        tiny=a.tiny,
        report=lambda record: print(json.dumps(record), flush=True),
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
