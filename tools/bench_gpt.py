"""Benchmark megadyn's training step on the reference GPT shapes; one JSON line, as the
Megatron-Core reference script prints it (same arguments, same fields, same FLOPs formula).

    torchrun --nproc-per-node 2 tools/bench_gpt.py --tp 2 --pp 1           # like mcore_gpt_bench.py
    torchrun --nproc-per-node 2 tools/bench_gpt.py --tp 2 --sp             # megadyn-only: sequence parallel

Llama-style models take pretrain_gpt.py's architecture flags (megadyn/bench/gpt_model.py):
--swiglu --normalization RMSNorm --position-embedding-type rope --rotary-base 500000
--disable-bias-linear --group-query-attention --num-query-groups 8 --ffn-hidden-size 8192;
--pointwise-fusion compiles the blocks' norms, residual adds, SwiGLU and RoPE (--no-norm-fusion,
--no-bias-swiglu-fusion, --no-rope-fusion, --no-bias-dropout-fusion take one part back).
Random tokens, bf16 weights with fp32 main weights, the distributed optimizer, untied
embeddings, no dropout: the configuration of the reference script (--use-precision-aware-optimizer:
remainders in place of the fp32 main weights, as pretrain_gpt.py's flag). The step timed is the
trainer's own (`Trainer.train_step`, built as pretrain_gpt.py builds it). Timing is the median
iteration after warm-up; peak memory is the maximum over ranks. The benchmark itself is
megadyn/bench/gpt.py (also `torchrun ... -m megadyn.bench gpt`).
"""

from megadyn.bench import run_gpt_tool

if __name__ == "__main__":
    run_gpt_tool(description=__doc__.splitlines()[0])
