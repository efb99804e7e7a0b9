#!/usr/bin/env bash
# The README's main job: build the corpus and tokenizer on this machine, then train a small GPT
# with tp 2 x pp 2 (4 processes on CPU; one process per GPU, at least 4, where there are GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
NPROC=4
if command -v nvidia-smi >/dev/null 2>&1; then
  GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
  [ "$GPUS" -ge 4 ] && NPROC=$GPUS
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  pretrain_gpt.py --default-job "$@"
