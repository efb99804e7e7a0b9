#!/bin/bash
# megadyn's default job: a small GPT on mock data with settings chosen by megadyn, on the GPUs
# of this node (or CPUs with gloo). Extra flags are passed through.
#
#   bash examples/train_default.sh [FLAGS...]
set -euo pipefail

NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$NPROC" -ge 1 ] || NPROC=1

DISTRIBUTED_ARGS=(
    --nproc-per-node "$NPROC"
    --nnodes 1
    --standalone
)

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py --default-job "$@"
