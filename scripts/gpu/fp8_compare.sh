#!/usr/bin/env bash
# On one GPU: FP8 against bf16, alternating in rounds (hosts drift), tp1, tools/bench_gpt.py:
#   ref     the 1.42B reference model (24 layers, hidden 2048, REFERENCE_MODEL's shape)
#   h4096   hidden 4096, 32 heads, ffn 16384, LAYERS_4096 layers (12 fit one 80 GB GPU with
#           fp32 main weights, gradients and Adam state; the distributed optimizer is off, as it
#           shards nothing at dp 1)
# A mode is bf16 or FORMAT/RECIPE, with +nocache to quantize each weight at every micro batch
# instead of once per step (--no-fp8-weight-cache), e.g. hybrid/tensorwise+nocache.
# Then (LOSS=1) the default job (tools/train_tokenizer's SentencePiece on the standard library's
# docstrings, 8 layers, hidden 512, seq 512) trained LOSS_ITERS steps in bf16 and in FP8, and
# the two loss curves compared (tools/compare_losses.py).
# Usage: bash scripts/gpu/fp8_compare.sh OUTDIR   (ROUNDS=2 ITERS=10 WARMUP=3 MODES="bf16
# e4m3/tensorwise hybrid/tensorwise" MODELS="ref h4096" LOSS=1 LOSS_ITERS=300 LOSS_FP8=hybrid)
#   QUICK=1   hidden-4096 row only: bf16 vs hybrid/tensorwise, 2 rounds, 5 timed iterations,
#             no loss runs (4 processes of about 25 s on an H100)
#   TINY=1    the same flow on a 2-layer, hidden-64 model (CPU smoke; no loss runs)
# Each row of OUTDIR/results.jsonl carries its process's wall seconds (wall_s).
set -uo pipefail
OUT=${1:-/tmp/megadyn_fp8}; mkdir -p "$OUT"
if [ "${QUICK:-0}" = 1 ] || [ "${TINY:-0}" = 1 ]; then
  MODELS=${MODELS:-h4096}; MODES=${MODES:-"bf16 hybrid/tensorwise"}; ITERS=${ITERS:-5}; LOSS=${LOSS:-0}
fi
ROUNDS=${ROUNDS:-2}; ITERS=${ITERS:-10}; WARMUP=${WARMUP:-3}; LAYERS_4096=${LAYERS_4096:-12}
MODES=${MODES:-"bf16 e4m3/tensorwise hybrid/tensorwise"}; MODELS=${MODELS:-"ref h4096"}
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
declare -A SHAPE=(
  [ref]="--layers 24 --hidden 2048 --heads 16"
  [h4096]="--layers $LAYERS_4096 --hidden 4096 --heads 32 --no-distributed-optimizer"
)
if [ "${TINY:-0}" = 1 ]; then
  TINY_SHAPE="--layers 2 --hidden 64 --heads 4 --seq 64 --vocab 128 --mbs 2 --gbs 8"
  SHAPE=([ref]="$TINY_SHAPE" [h4096]="$TINY_SHAPE --no-distributed-optimizer")
  ITERS=2; WARMUP=1
fi
start=$SECONDS
: > "$OUT/results.jsonl"
for round in $(seq 1 "$ROUNDS"); do
  for model in $MODELS; do
    for mode in $MODES; do
      fp8=(); base=${mode%+nocache}
      [ "$base" != bf16 ] && fp8=(--fp8-format "${base%/*}" --fp8-recipe "${base#*/}")
      [ "$base" != "$mode" ] && fp8+=(--no-fp8-weight-cache)
      log="$OUT/${model}_${mode//[\/+]/_}_r$round.log"
      t0=$SECONDS
      torchrun --standalone --nproc-per-node 1 tools/bench_gpt.py ${SHAPE[$model]} "${fp8[@]}" \
        --iters "$ITERS" --warmup "$WARMUP" > "$log" 2>&1 || tail -5 "$log"
      grep '^{' "$log" | sed "s|^{|{\"model\": \"$model\", \"mode\": \"$mode\", \"round\": $round, \"wall_s\": $((SECONDS - t0)), |" \
        >> "$OUT/results.jsonl"
    done
  done
done
python3 - "$OUT/results.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
if not rows:
    sys.exit("no results: see the logs beside results.jsonl")
print("| model | mode | tokens/s/GPU (each round) | median | vs bf16 | MFU (bf16 peak) | peak GiB | s per run |")
print("|---|---|---|---|---|---|---|---|")
for model in dict.fromkeys(r["model"] for r in rows):
    base = None
    for mode in dict.fromkeys(r["mode"] for r in rows if r["model"] == model):
        rs = [r for r in rows if r["model"] == model and r["mode"] == mode]
        tps = [r["tokens_per_s_per_gpu"] for r in rs]
        med = statistics.median(tps)
        base = base or med
        mfu = statistics.median(r["mfu"] for r in rs)
        print(f"| {model} | {mode} | {', '.join(f'{t:.0f}' for t in tps)} | {med:.0f} | "
              f"{med / base:.3f}x | {100 * mfu:.1f}% | {max(r['peak_mem_gib'] for r in rs):.1f} | "
              f"{', '.join(str(r['wall_s']) for r in rs)} |")
PY
echo "benchmark runs: $((SECONDS - start)) s"
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
