#!/usr/bin/env bash
# On a GPU machine with 2 GPUs: the cost of --num-distributed-optimizer-instances 2 (every
# optimizer shard held twice) on the 1.42B reference model at dp 2 with the distributed
# optimizer: first the 2-GPU parity test (one instance vs two, fp32 and bf16, the
# cross-instance all-reduce on its side stream), then tools/bench_gpt.py at 1 and 2 instances
# in alternating rounds, ROUNDS times (default 3). Writes parity.log, results.jsonl, table.md
# and runs.log (every run's output, one after the other).
# Usage: bash scripts/gpu/distopt_instances.sh OUTDIR [ITERS]
set -uo pipefail
OUT=${1:-/tmp/megadyn_distopt}; ITERS=${2:-8}; ROUNDS=${ROUNDS:-3}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout "${PARITY_TIMEOUT:-150}" python3 -c \
  "import tests.core.test_distopt_instances as t; t.test_two_instances_on_gpus()" > "$OUT/parity.log" 2>&1
echo "parity: exit code $?" | tee -a "$OUT/parity.log"
: > "$OUT/results.jsonl"; : > "$OUT/runs.log"; LOGS=$(mktemp -d)
for round in $(seq 1 "$ROUNDS"); do
  for n in 1 2; do
    log="$LOGS/n${n}_r${round}.log"
    timeout "${ROW_TIMEOUT:-120}" torchrun --standalone --nproc-per-node 2 tools/bench_gpt.py \
      --gbs 16 --num-distributed-optimizer-instances "$n" --iters "$ITERS" --warmup 3 \
      > "$log" 2>&1 || tail -5 "$log"
    grep '^{' "$log" | sed "s/^{/{\"round\": $round, /" >> "$OUT/results.jsonl"
    { echo "=== instances $n, round $round"; cat "$log"; } >> "$OUT/runs.log"
  done
done
python3 - "$OUT/results.jsonl" <<'PY' | tee "$OUT/table.md"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("| instances | tokens/s/GPU per round | median | iteration (s, median) | peak GiB |")
print("|---|---|---|---|---|")
for n in (1, 2):
    mine = [r for r in rows if r["distopt_instances"] == n]
    if mine:
        tps = [r["tokens_per_s_per_gpu"] for r in mine]
        its = statistics.median(r["iter_s"] for r in mine)
        peak = max(r["peak_mem_gib"] for r in mine)
        print(f"| {n} | {', '.join(map(str, tps))} | {statistics.median(tps)} | {its} | {peak} |")
PY
