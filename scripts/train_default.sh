#!/usr/bin/env bash
# The README's main job: build the corpus and tokenizer on this machine, then train a small GPT
# with tp 2 x pp 2 (4 processes on CPU; one process per GPU where there are GPUs: tp 2 x pp 2
# and dp over the rest from 4 GPUs, tp 2 on 2 or 3, a single GPU alone).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
NPROC=4
if command -v nvidia-smi >/dev/null 2>&1; then
  GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
  if [ "$GPUS" -ge 4 ]; then NPROC=$GPUS; elif [ "$GPUS" -ge 2 ]; then NPROC=2; elif [ "$GPUS" -eq 1 ]; then NPROC=1; fi
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  pretrain_gpt.py --default-job "$@"
