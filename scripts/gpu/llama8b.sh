#!/usr/bin/env bash
# On a 2-GPU machine: Llama 3 8B (32 layers, hidden 4096, 32 heads, 8 kv heads, ffn 14336,
# vocab 128256, untied, RoPE 5e5, RMSNorm, SwiGLU, no biases; 8.03 B weights), seq 8192, micro
# batch 1, global batch 16, through tools/bench_gpt.py: tokens/s/GPU and TFLOP/s/GPU (the model's
# FLOPs formula, megadyn/models/flops.py) of each run in RUNS, its peak memory, into
# OUTDIR/results.jsonl and OUTDIR/<run>.log.
#   fp8_dp2      the layout megadyn's planner picks for 2 GPUs of 139 GiB (dp 2, distributed
#                optimizer, no recomputation), FP8 hybrid tensorwise, weights cast each micro batch
#   bf16_dp2     the same in bf16
#   fp8_pp2      pp 2 with 2 virtual stages (the planner's second choice, 107 GiB), FP8
# Usage: bash scripts/gpu/llama8b.sh OUTDIR    (RUNS="fp8_dp2 bf16_dp2 fp8_pp2"; RUN_TIMEOUT 170 s)
set -uo pipefail
OUT=${1:?usage: llama8b.sh OUTDIR}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
SHAPE=(--layers 32 --hidden 4096 --heads 32 --group-query-attention --num-query-groups 8
  --ffn-hidden-size 14336 --vocab 128256 --seq 8192 --mbs 1 --gbs 16 --swiglu
  --normalization RMSNorm --position-embedding-type rope --rotary-base 500000
  --disable-bias-linear --untie-embeddings-and-output-weights --pointwise-fusion --iters 5 --warmup 3)
FP8=(--fp8-format hybrid --fp8-recipe tensorwise --no-fp8-weight-cache)
: > "$OUT/results.jsonl"
for run in ${RUNS:-fp8_dp2 bf16_dp2 fp8_pp2}; do
  case $run in
    fp8_dp2) extra=("${FP8[@]}") ;;
    bf16_dp2) extra=() ;;
    fp8_pp2) extra=(--pp 2 --vpp 2 "${FP8[@]}") ;;
    *) echo "llama8b.sh: unknown run '$run' in RUNS (fp8_dp2 bf16_dp2 fp8_pp2)"; exit 2 ;;
  esac
  cmd=(torchrun --standalone --nproc-per-node 2 tools/bench_gpt.py "${SHAPE[@]}" "${extra[@]}")
  echo "=== $run: ${cmd[*]}"
  timeout -k 10 "${RUN_TIMEOUT:-170}" "${cmd[@]}" > "$OUT/$run.log" 2>&1 || tail -6 "$OUT/$run.log"
  sed -n -e 's/^BENCH_JSON //p' -e t -e '/^{/p' "$OUT/$run.log" \
    | sed "s/^{/{\"run\": \"$run\", /" | tee -a "$OUT/results.jsonl"
done
