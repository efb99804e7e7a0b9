#!/bin/bash
# GPT 1.42B (the reference shape of shared/bench) on one node, bf16.
#
#   bash examples/train_gpt_single_node.sh [CHECKPOINT_DIR] [DATA_PREFIX] [VOCAB_FILE] [MERGE_FILE]
#
# Without DATA_PREFIX it trains on mock data (synthetic tokens, 50,257-token vocabulary padded to
# 50,304 as GPT-2's). Change the layout with TP, PP, GPUS_PER_NODE, GLOBAL_BATCH_SIZE, e.g.
#   TP=2 GPUS_PER_NODE=4 bash examples/train_gpt_single_node.sh
set -euo pipefail

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TP=${TP:-1}
PP=${PP:-1}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-16}
CHECKPOINT_PATH=${1:-checkpoints/gpt-1.4b}
DATA_PREFIX=${2:-}
VOCAB_FILE=${3:-gpt2-vocab.json}
MERGE_FILE=${4:-gpt2-merges.txt}

export CUDA_DEVICE_MAX_CONNECTIONS=1

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE"
    --nnodes 1
    --standalone
)

GPT_MODEL_ARGS=(
    --num-layers 24
    --hidden-size 2048
    --ffn-hidden-size 8192
    --num-attention-heads 16
    --seq-length 2048
    --max-position-embeddings 2048
    --position-embedding-type learned_absolute
    --untie-embeddings-and-output-weights
    --hidden-dropout 0.0
    --attention-dropout 0.0
    --init-method-std 0.02
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
    --seed 1234
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --use-distributed-optimizer
)
if [ "$TP" -gt 1 ]; then MODEL_PARALLEL_ARGS+=(--sequence-parallel); fi

if [ -n "$DATA_PREFIX" ]; then
    DATA_ARGS=(
        --data-path "$DATA_PREFIX"
        --split 949,50,1
        --tokenizer-type GPT2BPETokenizer
        --vocab-file "$VOCAB_FILE"
        --merge-file "$MERGE_FILE"
    )
else
    DATA_ARGS=(
        --mock-data
        --tokenizer-type NullTokenizer
        --vocab-size 50256
    )
fi

EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --log-throughput
    --eval-interval 1000
    --eval-iters 10
    --save-interval 1000
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --ckpt-keep-last 3
)
if [ -n "${WANDB_PROJECT:-}" ]; then
    EVAL_AND_LOGGING_ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "${WANDB_EXP_NAME:-gpt-1.4b}")
fi

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}"
