#!/usr/bin/env bash
# FP8 against bf16 in tools/bench_gpt.py at tp1 (one GPU) and tp2 with sequence parallelism (two
# GPUs), Megatron-Core's bf16 run of the reference model beside them at each tp, every row once a
# round, in rounds (hosts drift); then (LOSS=1) bf16 and FP8 loss curves. Models:
#   ref       the 1.42B reference model (24 layers, hidden 2048, REFERENCE_MODEL's shape)
#   h4096     hidden 4096, 32 heads, ffn 16384, LAYERS_4096 layers (12: 3.2B parameters, whose
#             fp32 main weights, gradients and Adam state, 18 bytes each, fit one 80 GB GPU)
#   h4096x24  the same with 24 layers (4.8B), tp2 only: 86 GB of state, 43 GB a GPU at tp2
# The hidden-4096 models run without the distributed optimizer (it shards nothing at dp 1).
# A mode is bf16 or FORMAT/RECIPE, with +nocache to quantize each weight at every micro batch
# instead of once per step (--no-fp8-weight-cache), e.g. hybrid/tensorwise+nocache, and +graph to
# replay each micro batch from a CUDA graph (--cuda-graph: eager FP8 and tp2 steps of the
# hidden-2048 model wait on the host), e.g. "bf16+graph hybrid/tensorwise+graph". The
# Megatron-Core row (.bench/mcore_gpt_bench.py, installed from .whl/ by scripts/gpu/mcore.sh;
# without them one line says so and the rest runs) has no sequence parallelism at tp2: its local
# layer spec refuses it.
# LOSS=1: the default job (tools/train_tokenizer's SentencePiece on the standard library's
# docstrings, 8 layers, hidden 512, seq 512) trained LOSS_ITERS steps in bf16 and in FP8 on one
# GPU, the two loss curves compared (tools/compare_losses.py).
#
# Usage, on a 2-GPU machine (CUDA_VISIBLE_DEVICES unset; carry .whl and .bench, BENCHMARKS.md):
#   bash scripts/gpu/fp8_compare.sh OUTDIR
# Variables (default): TPS ("1 2"), MODELS ("ref h4096 h4096x24"), MODES ("bf16 e4m3/tensorwise
# hybrid/tensorwise"), MCORE (1), ROUNDS (2), ITERS (10), WARMUP (3), LAYERS_4096 (12), LOSS (1),
# LOSS_ITERS (300), LOSS_FP8 (hybrid), BUDGET_S (none: no run starts after so many seconds, so
# that the table prints within a time limit). A tp with more GPUs than are visible is skipped
# with one line.
# The default is 34 runs of 20-45 s and 2 loss runs: about 20 minutes on 2 x H100. Within 10:
#   MODES="bf16 hybrid/tensorwise" ITERS=6 LOSS=0 BUDGET_S=520 bash scripts/gpu/fp8_compare.sh OUTDIR
#   QUICK=1  h4096 at tp1 only (unless TPS is given), bf16 vs hybrid/tensorwise, 5 timed
#            iterations, no loss runs (4 processes of about 25 s on an H100)
#   TINY=1   ref and h4096x24 as 2-layer, hidden-64 models, bf16 vs hybrid/tensorwise, no
#            Megatron-Core, no loss runs: a CPU smoke run (gloo, 2 processes at tp2; ~1 minute)
# Writes few files (the device machine returns 8): OUTDIR/results.jsonl (each row with its
# process's wall seconds, wall_s), table.md, logs.tgz (every log, rewritten after each run) and
# the loss runs' loss_bf16.jsonl and loss_fp8.jsonl.
set -uo pipefail
OUT=${1:-/tmp/megadyn_fp8}; mkdir -p "$OUT"; LOGS=$(mktemp -d)
if [ "${QUICK:-0}" = 1 ] || [ "${TINY:-0}" = 1 ]; then
  MODES=${MODES:-"bf16 hybrid/tensorwise"}; ITERS=${ITERS:-5}; LOSS=${LOSS:-0}
fi
[ "${QUICK:-0}" = 1 ] && MODELS=${MODELS:-h4096} && TPS=${TPS:-1}
[ "${TINY:-0}" = 1 ] && MODELS=${MODELS:-"ref h4096x24"} && MCORE=0
ROUNDS=${ROUNDS:-2}; ITERS=${ITERS:-10}; WARMUP=${WARMUP:-3}; LAYERS_4096=${LAYERS_4096:-12}
MODES=${MODES:-"bf16 e4m3/tensorwise hybrid/tensorwise"}; MODELS=${MODELS:-"ref h4096 h4096x24"}
TPS=${TPS:-"1 2"}; MCORE=${MCORE:-1}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
declare -A SHAPE=(
  [ref]="--layers 24 --hidden 2048 --heads 16"
  [h4096]="--layers $LAYERS_4096 --hidden 4096 --heads 32 --no-distributed-optimizer"
  [h4096x24]="--layers 24 --hidden 4096 --heads 32 --no-distributed-optimizer"
)
declare -A ONLY_TP=([h4096x24]=2)  # models that run at one tp only
NGPU=2  # TINY: gloo processes on the CPU
if [ "${TINY:-0}" = 1 ]; then
  TINY_SHAPE="--layers 2 --hidden 64 --heads 4 --seq 64 --vocab 1024 --mbs 2 --gbs 8"
  SHAPE=([ref]="$TINY_SHAPE" [h4096]="$TINY_SHAPE --no-distributed-optimizer")
  SHAPE[h4096x24]=${SHAPE[h4096]}
  ITERS=2; WARMUP=1
else
  NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())" || echo 0)
fi
start=$SECONDS
over_budget() { [ -n "${BUDGET_S:-}" ] && [ $((SECONDS - start)) -ge "$BUDGET_S" ]; }

tps=""
for tp in $TPS; do
  [ "$tp" -le "$NGPU" ] && tps+=" $tp" && continue
  echo "tp$tp skipped: $NGPU GPU(s) visible (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset})"
done
for model in $MODELS; do
  [ -n "${SHAPE[$model]:-}" ] || { echo "unknown model $model (ref h4096 h4096x24)"; exit 2; }
  for tp in $tps; do
    [ "${ONLY_TP[$model]:-$tp}" = "$tp" ] || echo "$model skipped at tp$tp: it runs at tp${ONLY_TP[$model]} only"
  done
done
MCORE_MODE=""  # the mode name of the Megatron-Core row, where it runs (model ref)
if [ "$MCORE" = 1 ] && [[ " $MODELS " == *" ref "* ]]; then
  source scripts/gpu/mcore.sh
  mcore_ready "$LOGS" && MCORE_MODE=mcore
fi

run_one() {  # run_one TP MODEL MODE ROUND: one benchmark process group, its line into results.jsonl
  local tp=$1 model=$2 mode=$3 round=$4 script=tools/bench_gpt.py args=(--tp "$1") base=${3%%+*}
  if [ "$mode" = mcore ]; then
    script=.bench/mcore_gpt_bench.py
  else
    [ "$tp" -gt 1 ] && args+=(--sp)
    [ "$base" != bf16 ] && args+=(--fp8-format "${base%/*}" --fp8-recipe "${base#*/}")
    [[ "$mode" == *+nocache* ]] && args+=(--no-fp8-weight-cache)
    [[ "$mode" == *+graph* ]] && args+=(--cuda-graph)
  fi
  local log="$LOGS/tp${tp}_${model}_${mode//[\/+]/_}_r$round.log" t0=$SECONDS
  torchrun --standalone --nproc-per-node "$tp" $script ${SHAPE[$model]} "${args[@]}" \
    --iters "$ITERS" --warmup "$WARMUP" > "$log" 2>&1 \
    || { echo "FAILED: tp$tp $model $mode round $round"; tail -5 "$log"; }
  grep '^{' "$log" | sed "s|^{|{\"model\": \"$model\", \"mode\": \"$mode\", \"round\": $round, \"wall_s\": $((SECONDS - t0)), |" \
    >> "$OUT/results.jsonl"
  tar czf "$OUT/logs.tgz" -C "$LOGS" .
}

: > "$OUT/results.jsonl"
for round in $(seq 1 "$ROUNDS"); do
  for tp in $tps; do
    for model in $MODELS; do
      [ "${ONLY_TP[$model]:-$tp}" = "$tp" ] || continue
      modes=$MODES; [ "$model" = ref ] && modes+=" $MCORE_MODE"
      for mode in $modes; do
        if over_budget; then echo "skipped, BUDGET_S=$BUDGET_S spent: tp$tp $model $mode round $round"
        else run_one "$tp" "$model" "$mode" "$round"; fi
      done
    done
  done
done
python3 - "$OUT/results.jsonl" << 'PY' | tee "$OUT/table.md"
import json, statistics, sys
runs = {}  # (tp, model, mode) -> its runs, in the order of the first round
for line in open(sys.argv[1]):
    r = json.loads(line)
    runs.setdefault((r["tp"], r["model"], r["mode"]), []).append(r)
if not runs:
    sys.exit("no results: see logs.tgz beside results.jsonl")
med = {k: statistics.median(r["tokens_per_s_per_gpu"] for r in rs) for k, rs in runs.items()}

def vs(key, mode):  # this row's median over that of `mode` at the same tp and model
    other = med.get((key[0], key[1], mode))
    return f"{med[key] / other:.3f}x" if other else "-"

print("| tp | model | mode | tokens/s/GPU (each round) | median | vs bf16 | vs Megatron-Core bf16 "
      "| MFU (bf16 peak) | peak GiB | s per run |")
print("|---|---|---|---|---|---|---|---|---|---|")
for key, rs in runs.items():
    tp, model, mode = key
    tps = ", ".join(f"{r['tokens_per_s_per_gpu']:.0f}" for r in rs)
    mfu = statistics.median(r["mfu"] for r in rs)
    print(f"| {tp}{' +SP' if rs[0]['sp'] else ''} | {model} | "
          f"{'Megatron-Core bf16' if mode == 'mcore' else mode} | {tps} | {med[key]:.0f} | "
          f"{vs(key, 'bf16+graph' if '+graph' in mode else 'bf16')} | {vs(key, 'mcore')} | {100 * mfu:.1f}% | "
          f"{max(r['peak_mem_gib'] for r in rs):.1f} | {', '.join(str(r['wall_s']) for r in rs)} |")
PY
echo "benchmark runs: $((SECONDS - start)) s"
[ "${LOSS:-1}" = 1 ] || exit 0
over_budget && { echo "loss runs skipped: BUDGET_S=$BUDGET_S spent"; exit 0; }
LOSS_ITERS=${LOSS_ITERS:-300}
for mode in bf16 fp8; do
  fp8=(); [ "$mode" = fp8 ] && fp8=(--fp8-format "${LOSS_FP8:-hybrid}" --fp8-recipe tensorwise)
  rm -rf "$OUT/ckpt_$mode"
  torchrun --standalone --nproc-per-node 1 pretrain_gpt.py --default-job "${fp8[@]}" \
    --train-iters "$LOSS_ITERS" --save "$OUT/ckpt_$mode" --save-interval 100000 \
    --metrics-file "$OUT/loss_$mode.jsonl" > "$LOGS/loss_$mode.log" 2>&1 || tail -20 "$LOGS/loss_$mode.log"
  rm -rf "$OUT/ckpt_$mode"
done
tar czf "$OUT/logs.tgz" -C "$LOGS" .
(cd "$OUT" && python3 "$OLDPWD/tools/compare_losses.py" loss_bf16.jsonl loss_fp8.jsonl)
