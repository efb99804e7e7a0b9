#!/usr/bin/env bash
# On a GPU machine: the 1.42B reference shape (shared/bench) trained by pretrain_gpt.py in bf16 on
# 1 and 2 GPUs, and Megatron-Core's reference benchmark on the same GPUs in the same command.
# Usage: bash scripts/gpu/reference_shape.sh OUTDIR   (needs .whl/ and .bench/, see BENCHMARKS.md)
set -uo pipefail
OUT=${1:-/tmp/megadyn_ref}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
source scripts/gpu/reference_model.sh
MODEL=("${REFERENCE_MODEL[@]}" --train-iters 16 --log-interval 4 --log-throughput)
for n in 1 2; do
  torchrun --standalone --nproc-per-node $n pretrain_gpt.py "${MODEL[@]}" > "$OUT/megadyn_train_${n}gpu.log" 2>&1 \
    || tail -20 "$OUT/megadyn_train_${n}gpu.log"
  grep "iteration       16" "$OUT/megadyn_train_${n}gpu.log" | sed "s/^/megadyn pretrain_gpt.py ${n} GPU:/"
  torchrun --standalone --nproc-per-node $n .bench/mcore_gpt_bench.py --tp 1 --iters 12 --warmup 4 \
    > "$OUT/mcore_${n}gpu.log" 2>&1 || tail -20 "$OUT/mcore_${n}gpu.log"
  grep '^{' "$OUT/mcore_${n}gpu.log" | sed "s/^/megatron-core ${n} GPU: /"
done
