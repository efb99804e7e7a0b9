#!/usr/bin/env bash
# On a GPU machine (2 GPUs), in one device call: dynamic against static context parallelism
# (--cp-placement dynamic / static) on document-masked 32k samples of the 1.42B reference model.
# Documents: packed, lengths log-normal with median 1024 tokens and sigma 1.6 (a few as long as
# the sample), cut at the sample's end (megadyn/bench/documents.py); the same samples for
# every row. Blocks of 1024 tokens.
#   1. attention of one layer (16 heads of 128), forward + backward, 3 samples: dynamic,
#      static_blocks (the static split through the same varlen calls) and the ring
#      (--cp-placement static, whose masked blocks run cuDNN once per document): times, each
#      rank's attention work and its imbalance, key/value blocks received
#   2. training steps of the 1.42B model (24 layers, hidden 2048, 16 heads), seq 32768, cp 2,
#      full recomputation, 2 micro batches per step: tokens/s per GPU for the same rows
# Writes OUTDIR/dcp.jsonl (records), dcp.md (tables) and rows.log.
# Usage: bash scripts/gpu/dcp_compare.sh OUTDIR              (under 4 minutes: BUDGET_S + 75 s at most)
#        TINY=1 bash scripts/gpu/dcp_compare.sh /tmp/d         (CPU: the flow only, ~1 minute)
set -uo pipefail
OUT=${1:-/tmp/megadyn_dcp}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
BUDGET_S=${BUDGET_S:-150}  # seconds for the runs; later ones are recorded as skipped
if [ "${TINY:-0}" = 1 ]; then
  export OMP_NUM_THREADS=1
  ARGS=(--seq 1024 --documents 128:1.2 --block 64 --samples 2 --heads 2 --head-dim 16 --iters 2
    --warmup 1 --e2e-iters 1 --e2e-warmup 1 --tokens 2048 --layers 2 --hidden 64 --vocab 1024)
else
  export OMP_NUM_THREADS=4
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
  ARGS=(--seq 32768 --documents 1024:1.6 --block 1024 --samples 3 --iters 5 --warmup 2
    --e2e-iters 2 --e2e-warmup 1 --tokens 65536)
fi
rm -f "$OUT/dcp.jsonl"
timeout $((BUDGET_S + 75)) torchrun --standalone --nproc-per-node 2 tools/bench_dcp_compare.py \
  --out "$OUT/dcp.jsonl" --budget-s "$BUDGET_S" "${ARGS[@]}" > "$OUT/rows.log" 2>&1 \
  || { echo "rows: exit $? (see rows.log)"; grep -v '^{' "$OUT/rows.log" | tail -15; }
python3 tools/bench_dcp_compare.py --summarize "$OUT/dcp.jsonl" | tee "$OUT/dcp.md"
echo "dcp_compare.sh: ${SECONDS}s"
