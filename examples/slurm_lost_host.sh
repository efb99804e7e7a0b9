#!/bin/bash
# GPT 1.42B on several SLURM nodes; a lost node is survived in-process. Submit with sbatch:
#
#   sbatch --nodes 3 --ntasks-per-node 1 --gpus-per-node 8 examples/slurm_lost_host.sh
#
# The first node of the allocation runs the coordinator (python -m megadyn.launch.coordinator:
# the job's store, apart from the training hosts) and no training; every other node runs one
# `python -m megadyn.launch` agent with its 8 workers. When a training node is lost, another
# agent declares it lost after --host-timeout seconds and the survivors train on in the same
# processes (docs/recovery.md, "Surviving a lost host"). To grow the job back, start an agent
# on a new node with the same command line and --replace-lost-host (from another allocation, or
# a spare node of this one): it takes the lost node's ranks, which join at a step boundary
# without restarting the survivors (docs/recovery.md, "A replacement host joining later"):
#
#   python -m megadyn.launch --nnodes "1:$TRAIN_NODES" --nproc-per-node 8 \
#       --coordinator "$COORDINATOR:$PORT" --rdzv-id "$SLURM_JOB_ID" --max-restarts 0 \
#       --host-timeout 5 --replace-lost-host pretrain_gpt.py <the same flags>
#SBATCH --job-name=megadyn-gpt
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=1
set -euo pipefail

NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
COORDINATOR=${NODES[0]}
PORT=${PORT:-29400}
TRAIN_NODES=$((SLURM_JOB_NUM_NODES - 1))
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

srun --nodes 1 --ntasks 1 -w "$COORDINATOR" \
    python -m megadyn.launch.coordinator --port "$PORT" &
sleep 5

# the training nodes: any of them may be lost; the job needs at least 1 of them
srun --nodes "$TRAIN_NODES" --ntasks "$TRAIN_NODES" --exclude "$COORDINATOR" \
    python -m megadyn.launch \
        --nnodes "1:$TRAIN_NODES" --nproc-per-node "$GPUS_PER_NODE" \
        --coordinator "$COORDINATOR:$PORT" --rdzv-id "$SLURM_JOB_ID" \
        --max-restarts 0 --host-timeout 5 \
    pretrain_gpt.py \
        --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 \
        --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 2 \
        --global-batch-size 256 --train-iters 100000 --lr 3e-4 --bf16 \
        --use-distributed-optimizer --num-distributed-optimizer-instances 2 \
        --mock-data --tokenizer-type NullTokenizer --vocab-size 50304 \
        --elastic-control-port 29600 --elastic-snapshot-interval 100 \
        --log-interval 10
kill %1
