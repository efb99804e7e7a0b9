#!/usr/bin/env bash
# On a GPU machine (2+ GPUs): where the tensor-parallel step's time goes with CUDA graphs.
# 1. Each of PROFILES (';'-separated bench_gpt.py arguments; default tp2, tp2 + SP and
#    tp2 + SP + --tp-comm-overlap, graphed) profiled for 2 iterations: compute, communication,
#    communication left exposed, idle, GEMM time (tools/trace_overlap.py), and the kernel
#    timelines (profiles.tgz).
# 2. bench_compare.sh rows ONLY (default: those three and the SP overlap row with settings that
#    change how NCCL and cuBLAS share SMs, given as EXTRA_ROWS).
# Usage: bash scripts/gpu/tp_overlap_probe.sh OUTDIR   (ROW_TIMEOUT, ITERS as bench_compare.sh)
set -uo pipefail
OUT=${1:-/tmp/megadyn_probe}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=4 PYTHONPATH=$PWD:${PYTHONPATH:-}
G="--tp 2 --cuda-graph"; SPO="--tp 2 --sp --tp-comm-overlap --cuda-graph"
IFS=';' read -ra PROFILE_ARGS <<< "${PROFILES:-$G;--tp 2 --sp --cuda-graph;$SPO}"
PROF=$(mktemp -d)
for args in "${PROFILE_ARGS[@]}"; do
  timeout "${ROW_TIMEOUT:-120}" torchrun --standalone --nproc-per-node 2 tools/bench_gpt.py $args \
    --iters 3 --warmup 3 --profile "$PROF" > "$PROF/run.log" 2>&1 || tail -5 "$PROF/run.log"
  grep "overlap per step" "$PROF/run.log" | tee -a "$OUT/overlap.txt"
done
tar czf "$OUT/profiles.tgz" -C "$PROF" --exclude='*.json' .
DEFAULT_EXTRA="tp2:sp_overlap_graph_conn1|2|$SPO|megadyn|CUDA_DEVICE_MAX_CONNECTIONS=1"
DEFAULT_EXTRA+=";tp2:sp_overlap_graph_carve16|2|$SPO --gemm-sm-carveout 16|megadyn"
LOGS=$(mktemp -d)
ONLY=${ONLY:-"tp2:graph tp2:sp_graph tp2:sp_overlap_graph tp2:sp_overlap_graph_conn1 \
tp2:sp_overlap_graph_carve16"} EXTRA_ROWS=${EXTRA_ROWS:-$DEFAULT_EXTRA} \
  bash scripts/gpu/bench_compare.sh "$LOGS" "${ITERS:-6}" | tee "$OUT/table.md"
cp "$LOGS/results.jsonl" "$OUT/"
tar czf "$OUT/logs.tgz" -C "$LOGS" .
