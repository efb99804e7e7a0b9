"""Benchmark megadyn's training step on the reference GPT shapes; one JSON line, as the
Megatron-Core reference script prints it (same arguments, same fields, same FLOPs formula).

    torchrun --nproc-per-node 2 tools/bench_gpt.py --tp 2 --pp 1           # like mcore_gpt_bench.py
    torchrun --nproc-per-node 2 tools/bench_gpt.py --tp 2 --sp             # megadyn-only: sequence parallel

Random tokens, bf16 weights with fp32 main weights, the distributed optimizer, untied
embeddings, no dropout: the configuration of the reference script. The step timed is the
trainer's own (`Trainer.train_step`, built as pretrain_gpt.py builds it; megadyn/bench/gpt.py).
Timing is the median iteration after warm-up; peak memory is the maximum over ranks.
"""

from __future__ import annotations

import json

import torch.distributed as dist

from megadyn.bench.gpt import parse_args, run_gpt_bench
from megadyn.launch.distributed_init import init_distributed


def main() -> None:
    a = parse_args(description=__doc__.splitlines()[0])
    device = init_distributed()
    res = run_gpt_bench(a, device)
    if dist.get_rank() == 0:
        print(json.dumps(res), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
