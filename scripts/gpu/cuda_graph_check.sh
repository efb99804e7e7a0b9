#!/usr/bin/env bash
# On a GPU machine (2+ GPUs, .whl/ and .bench/ carried, see BENCHMARKS.md): the CUDA graph against
# the eager step (losses and gradients: tp2, tp2 + SP, and tp2 + SP with --tp-comm-overlap over
# NCCL and over the copy engines, whose eager runs are also compared with plain SP), then the tp2
# rows with and without the graph and the overlap (the copy engines' also eager), both
# frameworks, ROUNDS times in turn.
# Usage: bash scripts/gpu/cuda_graph_check.sh OUTDIR   (ROUNDS, ITERS, ROW_TIMEOUT as bench_compare.sh)
set -uo pipefail
OUT=${1:-/tmp/megadyn_graph}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout 200 python3 -c "import tests.core.test_cuda_graph as t; t.test_cuda_graph_matches_eager_on_gpus()" \
  > "$OUT/parity.log" 2>&1
echo "parity: exit code $?" | tee -a "$OUT/parity.log"
grep "relative error" "$OUT/parity.log"
LOGS=$(mktemp -d)  # the run logs go into one archive: the device returns few files
ROUNDS=${ROUNDS:-2} ROW_TIMEOUT=${ROW_TIMEOUT:-120} \
  ONLY="tp2 tp2:sp_overlap_ce tp2:graph tp2:sp_graph tp2:sp_overlap_graph tp2:sp_overlap_ce_graph" \
  bash scripts/gpu/bench_compare.sh "$LOGS" "${ITERS:-6}" | tee "$OUT/table.md"
cp "$LOGS/results.jsonl" "$OUT/"
tar czf "$OUT/logs.tgz" -C "$LOGS" .
