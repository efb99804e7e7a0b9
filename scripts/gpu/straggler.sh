#!/usr/bin/env bash
# On a 2-GPU machine: the 1.42B reference model at dp 2 (global batch 32: 16 micro batches, so
# that a rebalance can split them finely), GPU 1 slowed by a competing loop of bf16 matmuls from
# iteration 14, under --elastic-straggler-policy log, rebalance and exclude in turn
# (scripts/gpu/straggler.py): tokens/s before the slowdown, with it under log, and after each
# action; the last JSON line holds each action's tokens/s over log's (issue 39 asks >= 1.3x).
# Usage: bash scripts/gpu/straggler.sh OUTDIR     (about 5 minutes)
set -uo pipefail
OUT=${1:-/tmp/megadyn_straggler}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
source scripts/gpu/reference_model.sh
python3 scripts/gpu/straggler.py --out "$OUT" --policies "${POLICIES:-log,rebalance,exclude}" \
  --slow-after 14 --tail 10 --timeout "${RUN_TIMEOUT:-150}" -- "${REFERENCE_MODEL[@]}" \
  --global-batch-size 32 --train-iters "${ITERS:-60}" --log-interval 2 --log-straggler \
  --straggler-threshold 1.3 --straggler-intervals 2
