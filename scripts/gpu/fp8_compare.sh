#!/usr/bin/env bash
# On one GPU: FP8 against bf16, alternating in rounds (hosts drift), tp1, tools/bench_gpt.py:
#   ref     the 1.42B reference model (24 layers, hidden 2048, REFERENCE_MODEL's shape)
#   h4096   hidden 4096, 32 heads, ffn 16384, LAYERS_4096 layers (12 fit one 80 GB GPU with
#           fp32 main weights, gradients and Adam state; the distributed optimizer is off, as it
#           shards nothing at dp 1)
# then (LOSS=1) the default job (tools/train_tokenizer's SentencePiece on the standard library's
# docstrings, 8 layers, hidden 512, seq 512) trained LOSS_ITERS steps in bf16 and in FP8, and
# the two loss curves compared (tools/compare_losses.py).
# Usage: bash scripts/gpu/fp8_compare.sh OUTDIR   (ROUNDS=2 ITERS=10 MODES="bf16 e4m3/tensorwise
# hybrid/tensorwise e4m3/rowwise" MODELS="ref h4096" LOSS=1 LOSS_ITERS=300 LOSS_FP8=hybrid)
set -uo pipefail
OUT=${1:-/tmp/megadyn_fp8}; mkdir -p "$OUT"
ROUNDS=${ROUNDS:-2}; ITERS=${ITERS:-10}; LAYERS_4096=${LAYERS_4096:-12}
MODES=${MODES:-"bf16 e4m3/tensorwise hybrid/tensorwise"}; MODELS=${MODELS:-"ref h4096"}
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
declare -A SHAPE=(
  [ref]="--layers 24 --hidden 2048 --heads 16"
  [h4096]="--layers $LAYERS_4096 --hidden 4096 --heads 32 --no-distributed-optimizer"
)
: > "$OUT/results.jsonl"
for round in $(seq 1 "$ROUNDS"); do
  for model in $MODELS; do
    for mode in $MODES; do
      fp8=(); [ "$mode" != bf16 ] && fp8=(--fp8-format "${mode%/*}" --fp8-recipe "${mode#*/}")
      log="$OUT/${model}_${mode/\//_}_r$round.log"
      torchrun --standalone --nproc-per-node 1 tools/bench_gpt.py ${SHAPE[$model]} "${fp8[@]}" \
        --iters "$ITERS" --warmup 3 > "$log" 2>&1 || tail -5 "$log"
      grep '^{' "$log" | sed "s|^{|{\"model\": \"$model\", \"mode\": \"$mode\", \"round\": $round, |" \
        >> "$OUT/results.jsonl"
    done
  done
done
python3 - "$OUT/results.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("| model | mode | tokens/s/GPU (each round) | median | vs bf16 | MFU (bf16 peak) | peak GiB |")
print("|---|---|---|---|---|---|---|")
for model in dict.fromkeys(r["model"] for r in rows):
    base = None
    for mode in dict.fromkeys(r["mode"] for r in rows if r["model"] == model):
        rs = [r for r in rows if r["model"] == model and r["mode"] == mode]
        tps = [r["tokens_per_s_per_gpu"] for r in rs]
        med = statistics.median(tps)
        base = base or med
        mfu = statistics.median(r["mfu"] for r in rs)
        print(f"| {model} | {mode} | {', '.join(f'{t:.0f}' for t in tps)} | {med:.0f} | "
              f"{med / base:.3f}x | {100 * mfu:.1f}% | {max(r['peak_mem_gib'] for r in rs):.1f} |")
PY
[ "${LOSS:-1}" = 1 ] || exit 0
LOSS_ITERS=${LOSS_ITERS:-300}
for mode in bf16 fp8; do
  fp8=(); [ "$mode" = fp8 ] && fp8=(--fp8-format "${LOSS_FP8:-hybrid}" --fp8-recipe tensorwise)
  rm -rf "$OUT/ckpt_$mode"
  torchrun --standalone --nproc-per-node 1 pretrain_gpt.py --default-job "${fp8[@]}" \
    --train-iters "$LOSS_ITERS" --save "$OUT/ckpt_$mode" --save-interval 100000 \
    --metrics-file "$OUT/loss_$mode.jsonl" > "$OUT/loss_$mode.log" 2>&1 || tail -20 "$OUT/loss_$mode.log"
  rm -rf "$OUT/ckpt_$mode"
done
(cd "$OUT" && python3 "$OLDPWD/tools/compare_losses.py" loss_bf16.jsonl loss_fp8.jsonl)
