"""Time a hot switch's moves two ways: the all-gather path and the reshard executor (JSON lines).

    torchrun --nproc-per-node 2 tools/bench_hot_switch.py --layers 24 --hidden 2048 --heads 16 \
        --ffn 8192 --vocab 50303 --bf16

Weights from dp N into tp N and gradients back, over all ranks, with both mechanisms; their
results must be bit-equal (megadyn/bench/hot_switch.py; also
`python -m megadyn.bench hot_switch`).
"""

from megadyn.bench.hot_switch import main

if __name__ == "__main__":
    main()
