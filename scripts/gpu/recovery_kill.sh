#!/usr/bin/env bash
# On a GPU machine (4 GPUs): the 1.42B reference model under torchrun, tp2 x pp2, bf16, distributed
# optimizer, in-memory snapshots every 20 steps into /dev/shm; one worker is killed (SIGKILL)
# after iteration 45, once snapshot 40 is complete, and tools/bench_recovery.py times kill ->
# next completed step.
# Usage: bash scripts/gpu/recovery_kill.sh OUTDIR
set -uo pipefail
OUT=${1:-/tmp/megadyn_recovery}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
FLAGS=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192
  --seq-length 2048 --max-position-embeddings 2048 --untie-embeddings-and-output-weights
  --mock-data --tokenizer-type NullTokenizer --vocab-size 50303 --micro-batch-size 2
  --global-batch-size 16 --bf16 --use-distributed-optimizer --overlap-grad-reduce --lr 1e-4
  --train-iters 60 --log-interval 1 --eval-interval 0 --num-workers 0 --hidden-dropout 0
  --attention-dropout 0 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
  --elastic-snapshot-interval 20 --elastic-snapshot-dir /dev/shm/megadyn_recovery)
rm -rf /dev/shm/megadyn_recovery
python3 tools/bench_recovery.py --nproc 4 --kill-after 45 --after-snapshot 40 --log "$OUT/recovery.log" -- "${FLAGS[@]}"
grep -E "recovery:|snapshot" "$OUT/recovery.log" | head -20
