#!/usr/bin/env bash
# On a GPU machine (2 GPUs as 2 hosts): the 1.42B reference model at dp 2 with replicated
# optimizer shards (--num-distributed-optimizer-instances 2), one `python -m megadyn.launch`
# agent per GPU (CUDA_VISIBLE_DEVICES 0 and 1; MEGADYN_HOST h0 and h1) and
# `python -m megadyn.launch.coordinator` as a third process; the host of rank 0 (its agent and
# its worker) is SIGKILLed after iteration 12 and scripts/gpu/lost_host.py times the kill to
# the survivor's next completed step. The GPUs of the two "hosts" do not see each other, so
# NCCL moves the gradients through host memory: steps are slower than on one host.
# Usage: bash scripts/gpu/lost_host.sh OUTDIR     (about 2 minutes)
set -uo pipefail
OUT=${1:-/tmp/megadyn_lost_host}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
source scripts/gpu/reference_model.sh
timeout "${RUN_TIMEOUT:-200}" python3 scripts/gpu/lost_host.py --hosts 2 --nproc-per-host 1 --gpus 0,1 \
  --kill-after 12 --log "$OUT/lost_host.log" -- "${REFERENCE_MODEL[@]}" \
  --num-distributed-optimizer-instances 2 --train-iters 20 --log-interval 1 \
  --elastic-control-port 29650 --elastic-heartbeat-timeout 30 | tee "$OUT/lost_host.json"
grep -E "is lost|event: failure|cannot recover|Error" "$OUT/lost_host.log" | head -5
