#!/usr/bin/env bash
# On a GPU machine (2 GPUs): the live change dp 2 -> tp 2 -> pp 2 of the 1.42B reference model
# (what smoke.sh's live_change check runs), in alternating rounds of this tree and an older one,
# each change's rebuild sampled (scripts/gpu/rebuild_sampler.py).
#   here:   git archive <commit> | (mkdir -p .old && tar -x -C .old)   # .old ignored, carried
#   there:  ROUNDS=2 bash scripts/gpu/live_change_rounds.sh OUTDIR .old
# Prints the ' elastic:' lines and the first iteration line after each change, per tree and round.
set -uo pipefail
OUT=${1:-/tmp/megadyn_live_rounds}; OLD=${2:-}; mkdir -p "$OUT"
HERE=$PWD
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
source scripts/gpu/reference_model.sh
run() {  # run TREE OUTDIR PORT
  local tree=$1 dir=$2 port=$3
  mkdir -p "$dir"
  (cd "$tree" && SAMPLES_DIR=$dir PYTHONPATH=$PWD timeout 170 torchrun --nproc-per-node 2 \
    --master-port $((port + 10)) "$HERE/scripts/gpu/rebuild_sampler.py" "${REFERENCE_MODEL[@]}" \
    --train-iters 36 --log-interval 1 --elastic-control-port "$port" > "$dir/job.log" 2>&1) &
  local job=$!
  for step in "8 --tp 2 --pp 1" "20 --tp 1 --pp 2"; do  # at iteration: the request
    set -- $step
    until grep -q "iteration *$1/" "$dir/job.log" 2>/dev/null || ! kill -0 $job 2>/dev/null; do sleep 0.5; done
    shift  # the tree's own tool: its requests are what its job reads
    (cd "$tree" && PYTHONPATH=$PWD python3 tools/elastic_ctl.py --port "$port" layout "$@") >> "$dir/ctl.log" 2>&1
  done
  wait $job
  grep -A1 "elastic: event" "$dir/job.log" | cut -c1-260
}
for round in $(seq "${ROUNDS:-2}"); do
  echo "== this tree, round $round"; run "$HERE" "$OUT/new$round" 29700
  if [ -n "$OLD" ]; then echo "== $OLD, round $round"; run "$OLD" "$OUT/old$round" 29720; fi
done
