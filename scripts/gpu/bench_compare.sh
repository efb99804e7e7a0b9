#!/usr/bin/env bash
# On a GPU machine: megadyn's benchmark and Megatron-Core's reference benchmark on the reference
# rows of shared/bench/README.md, in one command, then a table of ratios (tools/bench_table.py).
# Usage: bash scripts/gpu/bench_compare.sh OUTDIR [ITERS]   (needs .whl/ and .bench/, see BENCHMARKS.md;
# without them, megadyn's rows only)
# ONLY="tp1 tp2 tp2_sp" runs a subset of rows; MEGADYN_ARGS adds options to every megadyn run;
# ROW_TIMEOUT (s, default 300) stops a run that hangs; ROUNDS=N (default 1) runs all the rows N
# times in turn, and the table shows the median and each round's ratio (hosts drift, see
# BENCHMARKS.md). EXTRA_ROWS="name|nproc|args|frameworks|VAR=value ...;..." adds rows, the last
# field setting environment variables for that row only (they run when ONLY names them).
set -uo pipefail
OUT=${1:-/tmp/megadyn_bench}; ITERS=${2:-10}; ROW_TIMEOUT=${ROW_TIMEOUT:-300}; ROUNDS=${ROUNDS:-1}
mkdir -p "$OUT"
ONLY=${ONLY:-"tp1 tp2 pp2 tp2_pp2 tp2_pp2_vpp2 dp4 tp2_sp"}; MEGADYN_ARGS=${MEGADYN_ARGS:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
source scripts/gpu/mcore.sh
MCORE=1; mcore_ready "$OUT" || MCORE=0
ROWS=(  # name nproc args frameworks [env] (Megatron-Core's local spec refuses sequence parallelism)
  "tp1|1|--tp 1|mcore megadyn"
  "tp2|2|--tp 2|mcore megadyn"
  "pp2|2|--pp 2|mcore megadyn"
  "tp2_pp2|4|--tp 2 --pp 2|mcore megadyn"
  "tp2_pp2_vpp2|4|--tp 2 --pp 2 --vpp 2|mcore megadyn"
  "dp4|4|--gbs 32|mcore megadyn"
  "tp2_sp|2|--tp 2 --sp|megadyn"
  "dp4_no_param_overlap|4|--gbs 32 --no-overlap-param-gather|megadyn"
  # megadyn variants, compared with the Megatron-Core run of the row before the colon
  "tp1:graph|1|--tp 1 --cuda-graph|megadyn"
  "tp2:graph|2|--tp 2 --cuda-graph|megadyn"
  "tp2:sp_graph|2|--tp 2 --sp --cuda-graph|megadyn"
  "tp2:sp_overlap_graph|2|--tp 2 --sp --tp-comm-overlap --cuda-graph|megadyn"
  "tp2:sp_overlap_ce|2|--tp 2 --sp --tp-comm-overlap --tp-comm-overlap-transport copy-engine|megadyn"
  "tp2:sp_overlap_ce_graph|2|--tp 2 --sp --tp-comm-overlap --tp-comm-overlap-transport copy-engine --cuda-graph|megadyn"
  "dp4:graph|4|--gbs 32 --cuda-graph|megadyn"
)
IFS=';' read -ra EXTRA <<< "${EXTRA_ROWS:-}"
ROWS+=("${EXTRA[@]}")
: > "$OUT/results.jsonl"
for round in $(seq 1 "$ROUNDS"); do
  for row in "${ROWS[@]}"; do
    IFS='|' read -r name n args frameworks envs <<< "$row"
    [[ " $ONLY " == *" $name "* ]] || continue
    for fw in $frameworks; do
      [ "$fw" = mcore ] && [ "$MCORE" = 0 ] && continue
      script=tools/bench_gpt.py; extra=$MEGADYN_ARGS
      [ "$fw" = mcore ] && script=.bench/mcore_gpt_bench.py && extra=""
      log="$OUT/${fw}_${name}_r${round}.log"
      timeout "$ROW_TIMEOUT" env $envs torchrun --standalone --nproc-per-node "$n" $script $args $extra \
        --iters "$ITERS" --warmup 3 > "$log" 2>&1 || tail -5 "$log"
      grep '^{' "$log" | sed "s/^{/{\"row\": \"$name\", \"round\": $round, /" >> "$OUT/results.jsonl"
    done
  done
done
python3 tools/bench_table.py "$OUT/results.jsonl"
