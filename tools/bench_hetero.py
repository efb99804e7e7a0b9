"""Time replicas of different pipeline depth against grids: tokens/s per process used
(megadyn/bench/hetero.py, also `python -m megadyn.bench hetero`).

    python tools/bench_hetero.py --out DIR --iters 20 "grid pp3|3|--pipeline-model-parallel-size 3" \
        "templates 2+1|3|--heterogeneous-pipelines 2 1" -- MODEL FLAGS (pretrain_gpt.py's)
"""

import sys

from megadyn.bench.hetero import main

if __name__ == "__main__":
    sys.exit(main())
