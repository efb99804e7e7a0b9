#!/usr/bin/env bash
# On a GPU machine: the loss of megadyn's fast paths against the plain path, bf16, same seed and
# data. Reference: flash attention, weight gradients through param.grad, eager cross entropy.
# Ablations (ABLATIONS=0 skips them): one fast path at a time, and a Llama block with and without
# --pointwise-fusion. With 2 GPUs or more also: tp2 and tp2 + sequence parallel (fast paths),
# and dp2 with --overlap-param-gather (bit-equal to dp2 without it when the params arrive in
# time).
# Usage: bash scripts/gpu/fused_paths_bf16.sh OUTDIR
set -uo pipefail
OUT=${1:-/tmp/megadyn_fused}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
COMMON=(--num-layers 8 --hidden-size 1024 --num-attention-heads 8 --seq-length 2048
  --max-position-embeddings 2048 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
  --micro-batch-size 2 --global-batch-size 16 --bf16 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 5
  --train-iters 30 --log-interval 1 --eval-interval 0 --num-workers 0 --hidden-dropout 0
  --attention-dropout 0 --seed 1234 --use-distributed-optimizer --overlap-grad-reduce)
PLAIN=(--attention-backend flash --no-gradient-accumulation-fusion --no-cross-entropy-loss-fusion)
run() {  # name nproc flags...
  local name=$1 n=$2; shift 2
  rm -f "$OUT/$name.jsonl"  # appended to by pretrain_gpt.py
  torchrun --standalone --nproc-per-node "$n" pretrain_gpt.py "${COMMON[@]}" "$@" \
    --metrics-file "$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1 \
    || { echo "FAILED $name"; tail -20 "$OUT/$name.log"; }
}
run plain 1 "${PLAIN[@]}"
run fast 1
logs=(plain.jsonl fast.jsonl)
if [ "${ABLATIONS:-1}" = 1 ]; then  # one switch at a time (ABLATIONS=0 skips them)
  run cudnn_attention 1 --attention-backend fused --no-gradient-accumulation-fusion --no-cross-entropy-loss-fusion
  run wgrad_fusion 1 --attention-backend flash --no-cross-entropy-loss-fusion
  run fused_loss 1 --attention-backend flash --no-gradient-accumulation-fusion
  logs+=(cudnn_attention.jsonl wgrad_fusion.jsonl fused_loss.jsonl)
  # --pointwise-fusion (torch.compile'd norms, residual adds, SwiGLU, RoPE) on the Llama block
  LLAMA=(--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
    --group-query-attention --num-query-groups 4 --untie-embeddings-and-output-weights)
  run llama_plain 1 "${LLAMA[@]}" "${PLAIN[@]}"
  run llama_pointwise 1 "${LLAMA[@]}" "${PLAIN[@]}" --pointwise-fusion
fi
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  run tp2 2 --tensor-model-parallel-size 2
  run tp2_sp_plain 2 --tensor-model-parallel-size 2 --sequence-parallel "${PLAIN[@]}"
  run tp2_sp_fast 2 --tensor-model-parallel-size 2 --sequence-parallel
  run dp2_plain 2 "${PLAIN[@]}"
  run dp2_param_overlap 2 "${PLAIN[@]}" --overlap-param-gather
  logs+=(tp2.jsonl tp2_sp_plain.jsonl tp2_sp_fast.jsonl dp2_plain.jsonl dp2_param_overlap.jsonl)
fi
cd "$OUT" && python3 "$OLDPWD/tools/compare_losses.py" "${logs[@]}"
[ -f dp2_plain.jsonl ] && python3 "$OLDPWD/tools/compare_losses.py" dp2_plain.jsonl dp2_param_overlap.jsonl
[ -f llama_plain.jsonl ] && python3 "$OLDPWD/tools/compare_losses.py" llama_plain.jsonl llama_pointwise.jsonl
