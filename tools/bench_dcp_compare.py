"""Dynamic against static context parallelism on document-masked samples: one layer's
attention and training steps of the reference GPT, in one process per rank
(megadyn/bench/dcp_compare.py); or the markdown tables of a run.

    torchrun --nproc-per-node 2 tools/bench_dcp_compare.py --out dcp.jsonl --seq 32768
    python3 tools/bench_dcp_compare.py --summarize dcp.jsonl
"""

from __future__ import annotations

import torch.distributed as dist

from megadyn.bench.dcp_compare import main, parse, summarize
from megadyn.launch.distributed_init import init_distributed

if __name__ == "__main__":
    c = parse()
    if c.summarize:
        print(summarize(c.summarize))
    else:
        device = init_distributed()
        main(c, device)
        dist.destroy_process_group()
