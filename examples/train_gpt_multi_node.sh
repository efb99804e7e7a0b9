#!/bin/bash
# GPT 1.42B on several nodes, elastic. Run the same command on every node:
#
#   MASTER_ADDR=node0 MASTER_PORT=29500 NNODES=2:4 bash examples/train_gpt_multi_node.sh \
#       [CHECKPOINT_DIR] [DATA_PREFIX] [VOCAB_FILE] [MERGE_FILE]
#
# torchrun meets the other nodes through a c10d rendezvous at MASTER_ADDR:MASTER_PORT. NNODES
# may be a range MIN:MAX: nodes may join or leave, and torchrun restarts the worker group (up
# to MAX_RESTARTS times) after a failure; megadyn then rebuilds its state from its in-memory
# snapshots. ELASTIC_INITIAL_MEMBERS processes train from the start, the others wait as standby.
set -euo pipefail

: "${MASTER_ADDR:?set MASTER_ADDR to the rendezvous host}"
MASTER_PORT=${MASTER_PORT:-29500}
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RDZV_ID=${RDZV_ID:-megadyn-gpt}
MAX_RESTARTS=${MAX_RESTARTS:-3}
TP=${TP:-2}
PP=${PP:-2}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-64}
CHECKPOINT_PATH=${1:-checkpoints/gpt-1.4b}
DATA_PREFIX=${2:-}
VOCAB_FILE=${3:-gpt2-vocab.json}
MERGE_FILE=${4:-gpt2-merges.txt}

export CUDA_DEVICE_MAX_CONNECTIONS=1

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --rdzv-backend c10d
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
    --rdzv-id "$RDZV_ID"
    --max-restarts "$MAX_RESTARTS"
)

GPT_MODEL_ARGS=(
    --num-layers 24
    --hidden-size 2048
    --ffn-hidden-size 8192
    --num-attention-heads 16
    --seq-length 2048
    --max-position-embeddings 2048
    --untie-embeddings-and-output-weights
    --hidden-dropout 0.0
    --attention-dropout 0.0
)

TRAINING_ARGS=(
    --micro-batch-size 2
    --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-iters 100000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --bf16
    --lr 3.0e-4
    --min-lr 3.0e-5
    --lr-decay-style cosine
    --lr-warmup-iters 2000
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --num-layers-per-virtual-pipeline-stage 6
    --sequence-parallel
    --use-distributed-optimizer
    --overlap-grad-reduce
    --elastic-min-members $((TP * PP))
    --elastic-snapshot-interval 50
)
if [ -n "${ELASTIC_INITIAL_MEMBERS:-}" ]; then
    MODEL_PARALLEL_ARGS+=(--elastic-initial-members "$ELASTIC_INITIAL_MEMBERS")
fi

if [ -n "$DATA_PREFIX" ]; then
    DATA_ARGS=(
        --data-path "$DATA_PREFIX"
        --split 949,50,1
        --tokenizer-type GPT2BPETokenizer
        --vocab-file "$VOCAB_FILE"
        --merge-file "$MERGE_FILE"
    )
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50256)
fi

EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --log-throughput
    --eval-interval 1000
    --eval-iters 10
    --save-interval 1000
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
)
if [ -n "${WANDB_PROJECT:-}" ]; then
    EVAL_AND_LOGGING_ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "${WANDB_EXP_NAME:-gpt-1.4b-multi}")
fi

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}"
