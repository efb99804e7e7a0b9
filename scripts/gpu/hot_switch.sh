#!/usr/bin/env bash
# On a GPU machine with 2 GPUs: hot switching (--dynamic-parallelism) against the best static
# layout that holds the longest sequence, on the 1.42B reference model (scripts/gpu/
# reference_model.sh, with --seq-length 32768) over a synthetic corpus of log-normal document
# lengths (tools/make_length_corpus.py: median 1024 tokens, sigma 1.4, clipped at 32768 + 1;
# one document per sample, --sample-per-document, --micro-batch-tokens 32768).
#   static: tp 2 (dp 1) for every sample (context parallelism does not run with variable-length
#           samples yet, so tp 2 is the static layout that holds 32k tokens on 2 GPUs);
#   hot:    base dp 2 (distributed optimizer); the length planner sends each length to dp 2
#           while its micro batches fit MEMORY_GIB (default 60) and to tp 2 beyond, switching
#           the weights in and the gradients back within each step.
# First tools/bench_hot_switch.py times a switch's moves (weights dp 2 -> tp 2, gradients back)
# by the all-gather path that training uses and by the reshard planner + executor, and checks
# that both give bit-equal tensors (moves.jsonl). Then ITERS iterations of each row (default 20;
# with 5 timed steps one slow static step, a length seen first, read as 1.38x where 15 steps
# gave 1.13x); tokens/s is the tokens of the iterations after WARMUP (default 5) over their time: both rows
# draw the same samples, whose lengths differ from step to step, so a median of per-iteration
# rates would compare different steps (it overstated hot / static by up to 0.14). Writes
# OUTDIR/moves.jsonl, results.jsonl, table.md, static.log, hot.log (with the per-step group and
# switch lines) and the metrics files.
# HOT_MEMORY="60 72" runs one hot row per planner memory (GiB); table.md has every timed step.
# Usage: bash scripts/gpu/hot_switch.sh OUTDIR   (about 3.5 minutes on 2 x H100; at most 6.5:
#        timeouts of 45 s for the moves and 170 s per row)
#        TINY=1 bash scripts/gpu/hot_switch.sh OUTDIR   (CPU, gloo, a tiny model: the flow only)
set -uo pipefail
OUT=${1:-/tmp/megadyn_hot}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
ITERS=${ITERS:-20}; WARMUP=${WARMUP:-5}; GBS=${GBS:-32}; ROW_TIMEOUT=${ROW_TIMEOUT:-170}
source scripts/gpu/reference_model.sh
if [ "${TINY:-0}" = 1 ]; then
  SEQ=512; VOCAB=1000; ITERS=4; WARMUP=1; GBS=16
  MODEL=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128
    --lr 1e-4 --hidden-dropout 0 --attention-dropout 0 --use-distributed-optimizer)
  MOVES_FLAGS="--layers 2 --hidden 64 --heads 4 --ffn 128 --vocab $((VOCAB + 1))"
  CORPUS=(--num-documents 2000 --median 64 --sigma 1.2 --max-length $((SEQ + 1)))
  # the memory of a dp 2 micro batch of 400 tokens beside a tp 2 copy: longer samples go to tp 2
  MEMORY_GIB=$(python3 -c "
from megadyn.core.layout import Layout; from megadyn.core.recompute import RecomputeConfig
from megadyn.elastic.planning.layouts import memory_gib; from megadyn.models.config import GPTConfig
cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                vocab_size=$((VOCAB + 1)), max_position_embeddings=$SEQ)
rc = RecomputeConfig()
print(repr(memory_gib(cfg, Layout(dp=2), 1, 400, rc) + memory_gib(cfg, Layout(tp=2), 1, 0, rc, optimizer=False)))")
else
  SEQ=32768; VOCAB=50303
  MODEL=()  # the reference model less its data, length and batch flags
  skip=0
  for arg in "${REFERENCE_MODEL[@]}"; do
    if [ "$skip" = 1 ]; then skip=0; continue; fi
    case "$arg" in
      --seq-length|--max-position-embeddings|--micro-batch-size|--global-batch-size|--vocab-size|--tokenizer-type) skip=1 ;;
      --mock-data) ;;
      *) MODEL+=("$arg") ;;
    esac
  done
  MOVES_FLAGS="--bf16"  # the 1.42B shape is the tool's default
  CORPUS=(--num-documents 20000 --median 1024 --sigma 1.4 --max-length $((SEQ + 1)))
  MEMORY_GIB=${MEMORY_GIB:-60}
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
fi
# the two ways to move a switch's tensors (all-gather path, reshard executor): time, bit-equal
# shellcheck disable=SC2086
timeout "${MOVES_TIMEOUT:-45}" torchrun --standalone --nproc-per-node 2 tools/bench_hot_switch.py \
  $MOVES_FLAGS 2>&1 | grep '^{' | tee "$OUT/moves.jsonl"
python3 tools/make_length_corpus.py --output-prefix "$OUT/corpus" --vocab-size "$VOCAB" \
  "${CORPUS[@]}" | tee "$OUT/corpus.txt"
COMMON=("${MODEL[@]}" --seq-length "$SEQ" --max-position-embeddings "$SEQ"
  --data-path "$OUT/corpus" --split 100,0,0 --tokenizer-type NullTokenizer --vocab-size "$VOCAB"
  --sample-per-document --micro-batch-tokens "$SEQ" --global-batch-size "$GBS"
  --train-iters "$ITERS" --log-interval 1 --eval-interval 0 --num-workers 0 --seed 1234
  ${RECOMPUTE:-})
# shellcheck disable=SC2206
# HOT_MEMORY: the memory the length planner plans for, one hot row per value (hot, hot_<GiB>...)
declare -A ROWS=([static]="--tensor-model-parallel-size 2")
ORDER=(static)
for gib in ${HOT_MEMORY:-$MEMORY_GIB}; do
  row=hot; [ "${#ORDER[@]}" = 1 ] || row=hot_$gib
  ROWS[$row]="--dynamic-parallelism --dynamic-parallelism-memory-gib $gib"; ORDER+=("$row")
done
: > "$OUT/results.jsonl"
for row in "${ORDER[@]}"; do
  # shellcheck disable=SC2086
  timeout "$ROW_TIMEOUT" torchrun --standalone --nproc-per-node 2 pretrain_gpt.py "${COMMON[@]}" \
    ${ROWS[$row]} --metrics-file "$OUT/$row.metrics.jsonl" > "$OUT/$row.log" 2>&1 \
    || { echo "$row: exit $?"; tail -8 "$OUT/$row.log"; }
  python3 - "$OUT/$row.metrics.jsonl" "$row" "$WARMUP" >> "$OUT/results.jsonl" <<'PY'
import json, os, statistics, sys
from megadyn.training.metrics_log import iterations, read_metrics
path, row, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3])
its = iterations(read_metrics(path)) if os.path.exists(path) else {}
timed = [r for i, r in its.items() if i > warmup]
tps = [r["tokens_per_sec"] for r in timed]
seconds = sum(r["elapsed_ms"] for r in timed) / 1e3
steps = [r for r in read_metrics(path) if r["record"] == "dynamic_parallelism"] if its else []
switch_ms = [1e3 * r["switch_seconds"] for r in steps]
print(json.dumps({
    "row": row, "iterations": len(its),
    "tokens_per_s": sum(t * r["elapsed_ms"] / 1e3 for t, r in zip(tps, timed)) / seconds if tps else None,
    "median_tokens_per_s": statistics.median(tps) if tps else None,
    "iter_ms": statistics.median(r["elapsed_ms"] for i, r in its.items() if i > warmup) if tps else None,
    "peak_mem_gib": max((r.get("peak_mem_gib") or 0) for r in its.values()) if its else None,
    "losses": [round(r["losses"]["lm loss"], 4) for r in its.values()],
    "switch_ms_per_step": statistics.mean(switch_ms[warmup:] or switch_ms) if switch_ms else None,
    "switches": sum(r["switches"] for r in steps),
}))
PY
done
for row in "${ORDER[@]:1}"; do grep -m1 " dynamic parallelism: tp" "$OUT/$row.log"; done | tee "$OUT/plan.txt"
python3 - "$OUT/results.jsonl" "$OUT" "$WARMUP" <<'PY' | tee "$OUT/table.md"
import json, os, sys
from megadyn.training.metrics_log import iterations, read_metrics
rows = {r["row"]: r for r in map(json.loads, open(sys.argv[1]))}
# per timed step: each row's time; a hot row's groups (layout: samples, ms) beside it
steps = {}
for name in rows:
    path = f"{sys.argv[2]}/{name}.metrics.jsonl"
    if not os.path.exists(path):
        continue
    groups = {r["iteration"]: r["groups"] for r in read_metrics(path) if r["record"] == "dynamic_parallelism"}
    for i, r in iterations(read_metrics(path)).items():
        if i > int(sys.argv[3]):
            cell = f"{r['elapsed_ms']:.0f}"
            if i in groups:
                cell += " (" + ", ".join(f"{g['layout']}: {g['samples']} of {g['shortest']}-{g['longest']} in {1e3 * g['seconds']:.0f}" for g in groups[i]) + ")"
            steps.setdefault(i, {})[name] = cell
print("| iteration | " + " | ".join(f"{n} ms" for n in rows) + " |")
print("|---|" + "---|" * len(rows))
for i in sorted(steps):
    print(f"| {i} | " + " | ".join(steps[i].get(n, "-") for n in rows) + " |")
print()
print("| layout | tokens/s (all timed steps) | iteration ms (median) | peak GiB | switch ms/step (mean) | switches |")
print("|---|---|---|---|---|---|")
for name, r in rows.items():
    tps = r["tokens_per_s"] and round(r["tokens_per_s"])
    print(f"| {name} | {tps} | {r['iter_ms']} | {r['peak_mem_gib']} | {r['switch_ms_per_step']} | {r.get('switches')} |")
s = rows.get("static", {}).get("tokens_per_s")
for name, r in rows.items():
    if name != "static" and s and r.get("tokens_per_s"):
        print(f"\n{name} / static tokens/s: {r['tokens_per_s'] / s:.3f}x (goal 1.3x)")
PY
