#!/usr/bin/env bash
# On a GPU machine (2 GPUs): the 1.42B reference model at dp 2, bf16, under
# `python -m megadyn.launch --max-restarts 0` in elastic mode (--elastic-recovery in-process);
# one worker is killed (SIGKILL) after iteration 12 and tools/bench_recovery.py --in-process
# times kill -> next completed step, in the same processes. Three runs:
#   instances  the reference model's flags (distributed optimizer) with
#              --num-distributed-optimizer-instances 2: every optimizer shard is held twice, so the
#              survivor takes the dead rank's shard from its own copy (dp 2 -> dp 1)
#   replicas   without the distributed optimizer: the survivor holds every piece (dp 2 -> dp 1)
#   snapshot   with it (the reference model's flags): the dead rank's optimizer shard has no
#              replica, so the survivor loads the newest in-memory snapshot (every 5 steps)
#   cost       the redundancy's steady-state price: scripts/gpu/distopt_instances.sh (1 against
#              2 instances, alternating rounds; ROUNDS=2 here) into OUTDIR/cost
# Usage: bash scripts/gpu/recovery_in_process.sh OUTDIR   (RUNS="instances replicas snapshot cost"
# by default; about 6 minutes in all)
set -uo pipefail
OUT=${1:-/tmp/megadyn_recovery_in_process}; mkdir -p "$OUT"
# python -m megadyn.launch gives its workers what the recovery needs of NCCL (docs/recovery.md)
export NCCL_NVLS_ENABLE=0
export OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
source scripts/gpu/reference_model.sh
COMMON=(--train-iters 20 --log-interval 1 --elastic-control-port 29600 --elastic-heartbeat-timeout 30)
for run in ${RUNS:-instances replicas snapshot cost}; do
  if [ "$run" = cost ]; then
    ROUNDS=${ROUNDS:-2} bash scripts/gpu/distopt_instances.sh "$OUT/cost" 8 > /dev/null 2>&1
    cat "$OUT/cost/table.md" 2>/dev/null || echo "cost: no table (see $OUT/cost/runs.log)"
    continue
  fi
  if [ "$run" = instances ]; then
    FLAGS=("${REFERENCE_MODEL[@]}" --num-distributed-optimizer-instances 2)
    EXTRA=()
  elif [ "$run" = replicas ]; then
    FLAGS=(); for f in "${REFERENCE_MODEL[@]}"; do [ "$f" = --use-distributed-optimizer ] || FLAGS+=("$f"); done
    EXTRA=()
  else
    FLAGS=("${REFERENCE_MODEL[@]}")
    EXTRA=(--elastic-snapshot-interval 5 --elastic-snapshot-dir /dev/shm/megadyn_rip --after-snapshot 10)
    rm -rf /dev/shm/megadyn_rip
  fi
  SNAP=(); ARGS=("${FLAGS[@]}" "${COMMON[@]}")
  if [ "$run" = snapshot ]; then ARGS+=("${EXTRA[@]:0:4}"); SNAP=("${EXTRA[@]:4}"); fi
  timeout "${RUN_TIMEOUT:-170}" python3 tools/bench_recovery.py --in-process --nproc 2 --kill-after 12 "${SNAP[@]}" \
    --log "$OUT/$run.log" -- "${ARGS[@]}" | tee "$OUT/$run.json"
  grep -E "event: failure|cannot recover|Error" "$OUT/$run.log" | head -5
done
