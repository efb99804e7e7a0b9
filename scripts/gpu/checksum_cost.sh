#!/usr/bin/env bash
# On a GPU machine (2 GPUs): what the checkpoint checksums cost. The 1.42B reference model, dp 2,
# bf16, distributed optimizer (about 20 GB of weights, main weights and Adam moments), trains 2
# iterations and saves (--save), then a second run loads that checkpoint (--load) and stops.
# Prints the save and load times and the part spent on checksums (the "checksum_s" of the
# "saved checkpoint" and "loaded checkpoint" lines; a load checks in 8 reader threads per rank,
# so its checksum_s is their summed time, an upper bound on its share of the wall time).
# The checkpoint goes to CKPT_DIR (default: a new directory under /tmp), removed at the end.
# Usage: bash scripts/gpu/checksum_cost.sh OUTDIR     (under 2 minutes)
#        TINY=1 bash scripts/gpu/checksum_cost.sh /tmp/c  (CPU: the flow only, ~20 s)
set -uo pipefail
OUT=${1:-/tmp/megadyn_checksum}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
CKPT=${CKPT_DIR:-$(mktemp -d /tmp/megadyn_checksum_ckpt.XXXX)}
if [ "${TINY:-0}" = 1 ]; then
  export OMP_NUM_THREADS=1
  FLAGS=(--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16
    --max-position-embeddings 16 --mock-data --tokenizer-type NullTokenizer --vocab-size 60
    --micro-batch-size 1 --global-batch-size 4 --lr 1e-3 --eval-interval 0 --num-workers 0)
else
  export OMP_NUM_THREADS=4
  source scripts/gpu/reference_model.sh
  FLAGS=("${REFERENCE_MODEL[@]}")
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
fi
FLAGS+=(--train-iters 2 --log-interval 1 --save "$CKPT" --save-interval 2)
for step in save load; do
  extra=(); [ "$step" = load ] && extra=(--load "$CKPT")
  timeout 55 torchrun --standalone --nproc-per-node 2 pretrain_gpt.py "${FLAGS[@]}" "${extra[@]}" \
    > "$OUT/$step.log" 2>&1 || { echo "$step: exit $? (see $step.log)"; tail -5 "$OUT/$step.log"; }
done
rm -rf "$CKPT"
save_line=$(grep -h "saved checkpoint at" "$OUT/save.log" | tail -1)
load_line=$(grep -h "loaded checkpoint" "$OUT/load.log" | tail -1)
echo "$save_line" | sed -E 's/.* in ([0-9.]+) s \(checksum_s ([0-9.]+)\).*/\1 \2/' | \
  awk 'NF == 2 {printf "save: %.2f s, checksums %.2f s (%.1f%%)\n", $1, $2, 100 * $2 / $1}' | tee "$OUT/cost.txt"
echo "$load_line" | sed -E 's/.* read in ([0-9.]+) s \(checksum_s ([0-9.]+)\).*/\1 \2/' | \
  awk 'NF == 2 {printf "load: %.2f s, checksums %.2f s summed over the reader threads (%.1f%%)\n", $1, $2, 100 * $2 / $1}' | tee -a "$OUT/cost.txt"
echo "checksum_cost.sh: ${SECONDS}s"
