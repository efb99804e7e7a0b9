#!/usr/bin/env bash
# On a GPU machine: the 1.42B reference shape (shared/bench) trained by pretrain_gpt.py in bf16 on
# 1 and 2 GPUs, and Megatron-Core's reference benchmark on the same GPUs in the same command.
# Usage: bash scripts/gpu/reference_shape.sh OUTDIR   (needs .whl/ and .bench/, see BENCHMARKS.md)
set -uo pipefail
OUT=${1:-/tmp/megadyn_ref}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
MODEL=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192
  --seq-length 2048 --max-position-embeddings 2048 --untie-embeddings-and-output-weights
  --mock-data --tokenizer-type NullTokenizer --vocab-size 50303 --micro-batch-size 2
  --global-batch-size 16 --bf16 --use-distributed-optimizer --overlap-grad-reduce --lr 1e-4
  --train-iters 16 --log-interval 4 --eval-interval 0 --num-workers 0 --hidden-dropout 0
  --attention-dropout 0 --log-throughput)
for n in 1 2; do
  torchrun --standalone --nproc-per-node $n pretrain_gpt.py "${MODEL[@]}" > "$OUT/megadyn_train_${n}gpu.log" 2>&1 \
    || tail -20 "$OUT/megadyn_train_${n}gpu.log"
  grep "iteration       16" "$OUT/megadyn_train_${n}gpu.log" | sed "s/^/megadyn pretrain_gpt.py ${n} GPU:/"
  torchrun --standalone --nproc-per-node $n .bench/mcore_gpt_bench.py --tp 1 --iters 12 --warmup 4 \
    > "$OUT/mcore_${n}gpu.log" 2>&1 || tail -20 "$OUT/mcore_${n}gpu.log"
  grep '^{' "$OUT/mcore_${n}gpu.log" | sed "s/^/megatron-core ${n} GPU: /"
done
