#!/usr/bin/env bash
# On a GPU machine (4 GPUs): the 1.42B reference model under torchrun, tp2 x pp2, bf16, distributed
# optimizer, in-memory snapshots every 20 steps into /dev/shm; one worker is killed (SIGKILL)
# after iteration 45, once snapshot 40 is complete, and tools/bench_recovery.py times kill ->
# next completed step.
# Usage: bash scripts/gpu/recovery_kill.sh OUTDIR   (RECOVERY_ARGS adds pretrain_gpt.py flags,
# e.g. RECOVERY_ARGS=--no-elastic-fork-server to restart without the fork server)
set -uo pipefail
OUT=${1:-/tmp/megadyn_recovery}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
source scripts/gpu/reference_model.sh
FLAGS=("${REFERENCE_MODEL[@]}" --train-iters 60 --log-interval 1
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
  --elastic-snapshot-interval 20 --elastic-snapshot-dir /dev/shm/megadyn_recovery ${RECOVERY_ARGS:-})
rm -rf /dev/shm/megadyn_recovery
python3 tools/bench_recovery.py --nproc 4 --kill-after 45 --after-snapshot 40 --log "$OUT/recovery.log" -- "${FLAGS[@]}"
grep -E "recovery:|snapshot" "$OUT/recovery.log" | head -20
