"""Time a hot switch's moves two ways: the all-gather path and the reshard executor (JSON lines).

    torchrun --nproc-per-node 2 tools/bench_hot_switch.py --layers 24 --hidden 2048 --heads 16 \
        --ffn 8192 --vocab 50303 --bf16

Weights from dp N into tp N and gradients back, over all ranks, with both mechanisms; their
results must be bit-equal (megadyn/bench/hot_switch.py).
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from megadyn.bench.hot_switch import model_config, print_rows, run
from megadyn.launch.distributed_init import init_distributed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=50303)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    device = init_distributed()
    cfg = model_config(a.layers, a.hidden, a.heads, a.ffn, a.vocab, a.bf16)
    print_rows(run(cfg, device, a.repeats))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
