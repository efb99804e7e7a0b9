#!/usr/bin/env bash
# On a GPU machine (4 GPUs): the same model and data trained under several layouts in bf16 with
# nccl; prints how far each layout's loss curve is from the single-GPU run.
# Usage: bash scripts/gpu/layouts_bf16.sh OUTDIR
set -uo pipefail
OUT=${1:-/tmp/megadyn_layouts}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
COMMON=(--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
  --max-position-embeddings 1024 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
  --micro-batch-size 2 --global-batch-size 16 --bf16 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 5
  --train-iters 30 --log-interval 1 --eval-interval 0 --num-workers 0 --hidden-dropout 0
  --attention-dropout 0 --seed 1234)
run() {  # name nproc flags...
  local name=$1 n=$2; shift 2
  rm -f "$OUT/$name.jsonl"  # appended to by pretrain_gpt.py
  torchrun --standalone --nproc-per-node "$n" pretrain_gpt.py "${COMMON[@]}" "$@" \
    --metrics-file "$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1 \
    || { echo "FAILED $name"; tail -20 "$OUT/$name.log"; }
}
run tp1 1
run tp2 2 --tensor-model-parallel-size 2
run tp2_sp 2 --tensor-model-parallel-size 2 --sequence-parallel
run tp2_pp2 4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
run pp2_vpp2 2 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2
run tp2_sp_dp2_distopt 4 --tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer
cd "$OUT" && python3 "$OLDPWD/tools/compare_losses.py" tp1.jsonl tp2.jsonl tp2_sp.jsonl tp2_pp2.jsonl pp2_vpp2.jsonl tp2_sp_dp2_distopt.jsonl
