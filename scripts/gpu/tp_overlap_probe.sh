#!/usr/bin/env bash
# On a GPU machine (2+ GPUs): where the tensor-parallel step's time goes with CUDA graphs.
# 1. tp2, tp2 + SP and tp2 + SP + --tp-comm-overlap profiled (2 graphed iterations each):
#    compute, communication, communication left exposed, idle, GEMM time (tools/trace_overlap.py)
# 2. the SP overlap row beside tp2's with settings that change how NCCL and cuBLAS share SMs.
# Usage: bash scripts/gpu/tp_overlap_probe.sh OUTDIR   (ROW_TIMEOUT as bench_compare.sh)
set -uo pipefail
OUT=${1:-/tmp/megadyn_probe}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=4 PYTHONPATH=$PWD:${PYTHONPATH:-}
PROF=$(mktemp -d)
for args in "--tp 2 --cuda-graph" "--tp 2 --sp --cuda-graph" "--tp 2 --sp --tp-comm-overlap --cuda-graph"; do
  timeout "${ROW_TIMEOUT:-120}" torchrun --standalone --nproc-per-node 2 tools/bench_gpt.py $args \
    --iters 3 --warmup 3 --profile "$PROF" > "$PROF/run.log" 2>&1 || tail -5 "$PROF/run.log"
  grep "overlap per step" "$PROF/run.log" | tee -a "$OUT/overlap.txt"
done
tar czf "$OUT/profiles.tgz" -C "$PROF" --exclude='*.json' .
V="2|--tp 2 --sp --tp-comm-overlap --cuda-graph"
EXTRA_ROWS="tp2:sp_overlap_graph_conn1|$V|megadyn|CUDA_DEVICE_MAX_CONNECTIONS=1"
EXTRA_ROWS+=";tp2:sp_overlap_graph_nch8|$V|megadyn|NCCL_MAX_NCHANNELS=8"
EXTRA_ROWS+=";tp2:sp_overlap_graph_carve16|$V --gemm-sm-carveout 16|megadyn"
EXTRA_ROWS+=";tp2:sp_overlap_graph_carve32|$V --gemm-sm-carveout 32|megadyn"
LOGS=$(mktemp -d)
ONLY="tp2:graph tp2:sp_graph tp2:sp_overlap_graph tp2:sp_overlap_graph_conn1 tp2:sp_overlap_graph_nch8 \
tp2:sp_overlap_graph_carve16 tp2:sp_overlap_graph_carve32" EXTRA_ROWS=$EXTRA_ROWS \
  bash scripts/gpu/bench_compare.sh "$LOGS" "${ITERS:-6}" | tee "$OUT/table.md"
cp "$LOGS/results.jsonl" "$OUT/"
tar czf "$OUT/logs.tgz" -C "$LOGS" .
