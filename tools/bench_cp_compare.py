"""Context parallelism against tensor parallelism and torch's own cp at long sequences, every
row in one process per rank (megadyn/bench/cp_compare.py); or the markdown table of a run.

    torchrun --nproc-per-node 2 tools/bench_cp_compare.py --out runs.jsonl --rounds 2
    python3 tools/bench_cp_compare.py --summarize runs.jsonl
"""

from __future__ import annotations

import torch.distributed as dist

from megadyn.bench.cp_compare import main, parse, summarize
from megadyn.launch.distributed_init import init_distributed

if __name__ == "__main__":
    c = parse()
    if c.summarize:
        print(summarize(c.summarize))
    else:
        device = init_distributed()
        main(c, device)
        dist.destroy_process_group()
