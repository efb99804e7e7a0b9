#!/usr/bin/env bash
# On a GPU machine with 4 GPUs: the runs of issue 25 that need 4 GPUs, in parts, each part
# fitting one device call (10 minutes); list several parts to run them in one call.
#   reference  the 4-GPU reference rows, megadyn and Megatron-Core in turn, ROUNDS rounds (the
#              frameworks' order flips every round): tp2 x pp2, tp2 x pp2 x vpp2, dp4 (gbs 32),
#              and dp4 with the CUDA graph (megadyn only; pp > 1 cannot be captured yet).
#              Needs .whl/ (megatron-core 0.19.2) and .bench/mcore_gpt_bench.py, see BENCHMARKS.md.
#   reshard    live layout changes of the 1.42B model from tp2 x pp2 (tools/bench_reshard.py):
#              -> dp4 -> tp2 x dp2 -> cp2 x dp2 -> tp2 x pp2, against a DCP save + load of the same state.
#   recovery   kill -9 of one worker at tp2 x pp2 (1.42B, snapshots every 20 steps in
#              /dev/shm), restart path through torchrun (tools/bench_recovery.py), RECOVERY_RUNS.
#   inprocess  kill -9 of rank 1 (1.42B) under python -m megadyn.launch --max-restarts 0, the
#              survivors recover in the same processes (tools/bench_recovery.py --in-process):
#              tp2 x dp2 with 2 distributed-optimizer instances -> the planner's layout for 3
#              GPUs; dp 3 (no distributed optimizer) + 1 standby process that takes the dead
#              member's place; global batch 24 (dp 3 divides it). About 3 minutes.
#   hetero     heterogeneous pipelines, 1.42B model without the distributed optimizer
#              (tools/bench_hetero.py): 3 GPUs as a 2-stage and a 1-stage replica against the
#              grids for 3 GPUs (pp3; dp2, one GPU idle), tokens/s per GPU used, and a live
#              change from tp1 x pp2 x dp2 on 4 GPUs to 2 + 1 stages on 3 (about 4 minutes).
#   all        reference reshard recovery inprocess hetero (more than one call's 10 minutes:
#              BUDGET_S cuts it).
# Parts named in TODO below wait for
# their code: asking for one writes a line saying so. A new part is a function part_NAME that
# appends its records to $OUT/NAME.jsonl and its table to $OUT/suite.md.
# Usage: bash scripts/gpu/four_gpu_suite.sh OUTDIR PART...
# Writes under OUTDIR (few files: the device tool returns at most 8): suite.md (every table),
# PART.jsonl (raw records), logs.tgz (every log, nvidia-smi, versions; rewritten after each run).
# Settings: BUDGET_S (default 560) seconds from the start after which no run starts that would not
# end in time (each run is estimated from the last of its kind, and bounded by timeout);
# reference: ROUNDS (2), ITERS (6), REF_ROWS (the four rows above), ROW_TIMEOUT (120),
# REF_FRAMEWORKS ("mcore megadyn"); reshard: CHANGES ("dp4 tp2xdp2 cp2xdp2 tp2xpp2"), RESHARD_TIMEOUT
# (300); recovery: RECOVERY_RUNS ("default default"; "no-fork-server" restarts without the fork
# server), RECOVERY_TIMEOUT (200); inprocess: INPROCESS_RUNS ("tp2xdp2 dp3+standby"),
# INPROCESS_ITERS (16), INPROCESS_KILL_AFTER (8), INPROCESS_TIMEOUT (150); hetero: HETERO_ITERS
# (16), HETERO_CHANGE_AT (8), HETERO_TIMEOUT (240). TINY=1: a tiny model on any machine (a CPU
# smoke run of the script: reshard, recovery, inprocess and hetero with gloo, reference
# megadyn-only).
set -uo pipefail
usage() {  # the header above; on a wrong call only its usage line
  [ "${1:-0}" = 0 ] && sed -n '2,/^set -uo/{/^set -uo/d; s/^# \{0,1\}//; p}' "$0" \
    || grep -m1 '^# Usage:' "$0" | cut -c3- >&2
  exit "${1:-0}"
}
[ $# -ge 2 ] || usage 2
OUT=$1; shift
declare -A TODO=()  # every part's code exists; the live change to cp2 x dp2 is in reshard
PARTS=()
for p in "$@"; do
  case $p in
    all) PARTS+=(reference reshard recovery inprocess hetero) ;;
    reference | reshard | recovery | inprocess | hetero) PARTS+=("$p") ;;
    -h | --help) usage 0 ;;
    *) [ -n "${TODO[$p]:-}" ] && PARTS+=("$p") || { echo "unknown part: $p" >&2; usage 2; } ;;
  esac
done
mkdir -p "$OUT"
LOGS=$(mktemp -d)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
source scripts/gpu/mcore.sh
BUDGET_S=${BUDGET_S:-560}; TINY=${TINY:-0}; START=$SECONDS
left() { echo $((BUDGET_S - (SECONDS - START))); }
min() { [ "$1" -lt "$2" ] && echo "$1" || echo "$2"; }
md() { echo "$*" >> "$OUT/suite.md"; }
save_logs() { tar czf "$OUT/logs.tgz" -C "$LOGS" . 2> /dev/null; }
fits() {  # fits NEED_S WHAT: true when NEED_S seconds are left, else a line in suite.md
  [ "$(left)" -ge "$1" ] && return 0
  md "- skipped: $2 (about $1 s needed, $(left) s of BUDGET_S=$BUDGET_S left)"; return 1
}

{
  date -u; echo "parts: ${PARTS[*]}"; echo "commit: ${SUITE_COMMIT:-$(git rev-parse HEAD 2> /dev/null)}"
  nvidia-smi -L 2> /dev/null; nvidia-smi topo -m 2> /dev/null
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
} > "$LOGS/env.txt" 2>&1
NGPU=$(nvidia-smi -L 2> /dev/null | wc -l)
: > "$OUT/suite.md"
md "# four_gpu_suite.sh $*"
md ""
md "$(date -u '+%Y-%m-%d %H:%M UTC'), $(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | sort | uniq -c | sed 's/^ *//' | paste -sd, -)$( [ "$TINY" = 1 ] && echo ', TINY=1 (tiny model)'), $(grep ^torch "$LOGS/env.txt")"
if [ "$TINY" != 1 ] && [ "$NGPU" -lt 4 ]; then
  md ""; md "Only $NGPU GPUs here: every part needs 4. Nothing ran."; cat "$OUT/suite.md"; exit 1
fi

# ---------------------------------------------------------------------------------------------
part_reference() {
  local rows=${REF_ROWS:-"tp2_pp2 tp2_pp2_vpp2 dp4 dp4:graph"} rounds=${ROUNDS:-2} iters=${ITERS:-6}
  local frameworks=${REF_FRAMEWORKS:-"mcore megadyn"} est=${ROW_ESTIMATE_S:-60}
  local -A ARGS=(  # the rows of scripts/gpu/bench_compare.sh; "base:variant" rows are megadyn's
    [tp2_pp2]="4|--tp 2 --pp 2" [tp2_pp2_vpp2]="4|--tp 2 --pp 2 --vpp 2" [dp4]="4|--gbs 32"
    [dp4:graph]="4|--gbs 32 --cuda-graph" [tp2_dp2]="4|--tp 2 --gbs 32"
    [tp2_dp2:sp_overlap_ce_graph]="4|--tp 2 --gbs 32 --sp --tp-comm-overlap --tp-comm-overlap-transport copy-engine --cuda-graph"
  )
  local tiny=()
  [ "$TINY" = 1 ] && tiny=(--layers 2 --hidden 64 --heads 4 --seq 64 --vocab 1024) && frameworks=megadyn
  if [[ " $frameworks " == *" mcore "* ]] && ! mcore_ready "$LOGS" > "$LOGS/mcore.txt"; then
    md "- $(< "$LOGS/mcore.txt")"; frameworks=megadyn
  fi
  : > "$OUT/reference.jsonl"
  for round in $(seq 1 "$rounds"); do
    order=$frameworks; [ $((round % 2)) = 0 ] && order=$(echo "$frameworks" | tr ' ' '\n' | tac | paste -sd' ')
    for name in $rows; do
      [ -n "${ARGS[$name]:-}" ] || { md "- unknown reference row: $name"; continue; }
      IFS='|' read -r n args <<< "${ARGS[$name]}"
      for fw in $order; do
        [ "$fw" = mcore ] && [[ $name == *:* ]] && continue  # megadyn-only variant
        fits "$est" "reference $name $fw round $round" || continue
        script=tools/bench_gpt.py; [ "$fw" = mcore ] && script=.bench/mcore_gpt_bench.py
        log="$LOGS/reference_${fw}_${name/:/-}_r${round}.log"; t0=$SECONDS
        timeout "$(min "${ROW_TIMEOUT:-120}" "$(left)")" torchrun --standalone --nproc-per-node "$n" \
          $script $args "${tiny[@]}" --iters "$iters" --warmup 3 > "$log" 2>&1 \
          || { echo "FAILED reference $name $fw r$round"; tail -5 "$log"; }
        echo "reference $name $fw round $round: $((SECONDS - t0)) s" | tee -a "$LOGS/times.txt"
        [ $((SECONDS - t0)) -gt "$est" ] && est=$((SECONDS - t0))
        grep '^{' "$log" | sed "s/^{/{\"row\": \"$name\", \"round\": $round, /" >> "$OUT/reference.jsonl"
        save_logs
      done
    done
  done
  md ""; md "## reference: $rounds rounds (the frameworks' order flips each round), $iters timed iterations after 3 warm-up, median"
  md ""; md "$(python3 tools/bench_table.py "$OUT/reference.jsonl" 2>&1)"
  md ""; md "megadyn iteration seconds per run (row round: timed iterations):"
  md "$(python3 - "$OUT/reference.jsonl" << 'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("iters_s"):
        print(f"- {r['row']} r{r['round']} {r['framework']}: {r['iters_s']}")
EOF
)"
}

# ---------------------------------------------------------------------------------------------
part_reshard() {
  local changes=${CHANGES:-"dp4 tp2xdp2 cp2xdp2 tp2xpp2"} log="$LOGS/reshard.log" tiny=()
  [ "$TINY" = 1 ] && tiny=(--tiny)
  : > "$OUT/reshard.jsonl"
  fits "${RESHARD_ESTIMATE_S:-150}" "reshard ($changes)" || return
  local t0=$SECONDS
  timeout "$(min "${RESHARD_TIMEOUT:-300}" "$(left)")" torchrun --standalone --nproc-per-node 4 \
    tools/bench_reshard.py --changes $changes --ckpt-dir /tmp/megadyn_reshard_ckpt "${tiny[@]}" \
    > "$log" 2>&1 || { echo "FAILED reshard"; tail -20 "$log"; }
  echo "reshard: $((SECONDS - t0)) s" | tee -a "$LOGS/times.txt"
  rm -rf /tmp/megadyn_reshard_ckpt
  grep '^{' "$log" >> "$OUT/reshard.jsonl"
  save_logs
  md ""; md "## reshard: tools/bench_reshard.py --changes $changes (from tp2 x pp2 after 2 steps)"
  md ""; md "$(python3 - "$OUT/reshard.jsonl" << 'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("| change | live total (s) | plan (s) | reshard (s) | rebuild (s) | bytes moved | largest send / rank "
      "| first step after (s) | DCP save + load (s) | checkpoint / live |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['change']} | {r['live_s']:.2f} | {r['plan_s']:.2f} | {r['reshard_s']:.2f} "
          f"| {r['rebuild_s']:.2f} | {r['bytes_moved_gb']} GB | {r['max_rank_send_gb']} GB "
          f"| {r['first_step_s']:.2f} | {r['dcp_save_s']} + {r['dcp_load_s']} | {r['ckpt_over_live']}x |")
if rows:
    print(f"\nPoint-to-point GPU0 -> GPU1: {rows[0]['p2p_gb_s']} GB/s.")
else:
    print("(no records: see reshard.log in logs.tgz)")
EOF
)"
}

# ---------------------------------------------------------------------------------------------
md_table() {  # md_table TITLE PART < PYTHON: a section of suite.md whose table PYTHON prints from
  # `rows`, PART.jsonl's records (json, re and sys imported)
  local body; body=$(cat)
  md ""; md "## $1"; md ""
  md "$(python3 -c "import json, re, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
if not rows:
    print('(no records: see the $2 logs in logs.tgz)')
    sys.exit()
$body" "$OUT/$2.jsonl" 2>&1)"
}

keep_records() {  # keep_records JSON_LOG RUN VARIANT PART: its JSON lines, tagged, into PART.jsonl
  grep '^{' "$1" | sed "s/^{/{\"run\": $2, \"variant\": \"$3\", /" >> "$OUT/$4.jsonl"
}

recovery_model() {  # MODEL: the 1.42B reference model's flags; TINY=1: tools/bench_reshard.py --tiny's fp32 model
  source scripts/gpu/reference_model.sh
  MODEL=("${REFERENCE_MODEL[@]}")
  [ "$TINY" = 1 ] || return 0
  local -A small=([--num-layers]=4 [--hidden-size]=64 [--ffn-hidden-size]=256 [--seq-length]=32
    [--max-position-embeddings]=32 [--num-attention-heads]=4 [--vocab-size]=1023)
  for j in "${!MODEL[@]}"; do
    [ -n "${small[${MODEL[$j]}]:-}" ] && MODEL[j+1]=${small[${MODEL[$j]}]}
  done
  local kept=(); for f in "${MODEL[@]}"; do [ "$f" = --bf16 ] || kept+=("$f"); done; MODEL=("${kept[@]}")
}

part_hetero() {
  local iters=${HETERO_ITERS:-16} at=${HETERO_CHANGE_AT:-8} log="$LOGS/hetero.log" model=() MODEL
  recovery_model
  for f in "${MODEL[@]}"; do  # templates run without the distributed optimizer (yet)
    [ "$f" = --use-distributed-optimizer ] || model+=("$f")
  done
  [ "$TINY" = 1 ] && iters=8 && at=4 && model+=(--num-layers 6)  # pp3 needs layers / 3
  : > "$OUT/hetero.jsonl"
  fits "${HETERO_ESTIMATE_S:-240}" "hetero (4 runs of the 1.42B model)" || return
  local t0=$SECONDS
  timeout "$(min "${HETERO_TIMEOUT:-240}" "$(left)")" python3 tools/bench_hetero.py \
    --out "$LOGS/hetero" --iters "$iters" --change-at "$at" --timeout 120 \
    "templates 2+1|3|--heterogeneous-pipelines 2 1" \
    "grid pp3|3|--pipeline-model-parallel-size 3" \
    "tp1xpp2xdp2 -> 2+1 live|4|--pipeline-model-parallel-size 2 --heterogeneous-pipelines|2 1" \
    "grid dp2, 1 GPU idle|2|" \
    -- "${model[@]}" > "$log" 2>&1 || { echo "FAILED hetero"; tail -20 "$log"; }
  echo "hetero: $((SECONDS - t0)) s" | tee -a "$LOGS/times.txt"
  grep '^{' "$log" >> "$OUT/hetero.jsonl"
  save_logs
  md ""; md "## hetero: replicas of different pipeline depth (tools/bench_hetero.py, $iters iterations, median after 3 warm-up; live change after iteration $at; no distributed optimizer)"
  md ""; md "$(sed -n '/^| run /,$p' "$log")"
}

# ---------------------------------------------------------------------------------------------
part_recovery() {
  local runs=${RECOVERY_RUNS:-"default default"} est=${RECOVERY_ESTIMATE_S:-120} i=0 MODEL
  recovery_model
  local model=("${MODEL[@]}") steps=(60 20 45 40)  # iterations, snapshot interval, kill after iteration, once snapshot
  [ "$TINY" = 1 ] && steps=(20 5 12 10)
  : > "$OUT/recovery.jsonl"
  for run in $runs; do
    i=$((i + 1))
    fits "$est" "recovery run $i ($run)" || continue
    local extra=() log="$LOGS/recovery_${i}_${run}.log" t0=$SECONDS
    [ "$run" = no-fork-server ] && extra=(--no-elastic-fork-server)
    rm -rf /dev/shm/megadyn_recovery
    # SIGINT on timeout: bench_recovery.py then still writes out its log (and torchrun stops)
    timeout -s INT -k 20 "$(min "${RECOVERY_TIMEOUT:-200}" "$(left)")" python3 tools/bench_recovery.py \
      --nproc 4 --kill-after "${steps[2]}" --after-snapshot "${steps[3]}" --port $((29400 + i)) \
      --log "$log" -- "${model[@]}" --train-iters "${steps[0]}" --log-interval 1 \
      --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
      --elastic-snapshot-interval "${steps[1]}" \
      --elastic-snapshot-dir /dev/shm/megadyn_recovery "${extra[@]}" > "$log.json" 2> "$log.err" \
      || { echo "FAILED recovery run $i"; tail -n 5 "$log.err" "$log"; }
    echo "recovery $i $run: $((SECONDS - t0)) s" | tee -a "$LOGS/times.txt"
    [ $((SECONDS - t0)) -gt "$est" ] && est=$((SECONDS - t0))
    keep_records "$log.json" "$i" "$run" recovery
    rm -rf /dev/shm/megadyn_recovery
    save_logs
  done
  md_table "recovery: kill -9 of one worker at tp2 x pp2 after iteration ${steps[2]} once snapshot ${steps[3]} is complete (snapshots every ${steps[1]} steps, restart path)" recovery << 'EOF'
def phases(line):
    out = {}
    m = re.search(r"failure to completed step \d+: ([0-9.]+) s", line or "")
    out["job's line (from the last heartbeat)"] = m.group(1) if m else "-"
    m = re.search(r"process started (-?[0-9.]+) s after it", line or "")
    out["process started after the last heartbeat"] = m.group(1) if m else "-"
    tail = (line or "").split("s after it, ", 1)[-1] if m else ""
    for name, secs in re.findall(r"(.+?) (-?\d+\.\d) s(?:, |$)", tail):
        out[name] = secs
    return out
cols = [phases(r.get("job_recovery_line")) for r in rows]
names = []
for c in cols:
    names += [k for k in c if k not in names]
print("| | " + " | ".join(f"run {r['run']}, {r['variant']}" for r in rows) + " |")
print("|---|" + "---|" * len(rows))
print("| **kill -> next completed step** | " + " | ".join(f"**{r['kill_to_next_step_s']}**" for r in rows) + " |")
for key in ("killed_after_iteration", "resumed_from_snapshot", "exit_code"):
    print(f"| {key.replace('_', ' ')} | " + " | ".join(str(r.get(key)) for r in rows) + " |")
for n in names:
    print(f"| {n} | " + " | ".join(c.get(n, "-") for c in cols) + " |")
EOF
}

# ---------------------------------------------------------------------------------------------
part_inprocess() {
  local runs=${INPROCESS_RUNS:-"tp2xdp2 dp3+standby"} est=${INPROCESS_ESTIMATE_S:-100} i=0 MODEL
  local iters=${INPROCESS_ITERS:-16} kill=${INPROCESS_KILL_AFTER:-8}
  recovery_model
  : > "$OUT/inprocess.jsonl"
  for run in $runs; do
    i=$((i + 1))
    fits "$est" "in-process recovery $run" || continue
    local flags=() log="$LOGS/inprocess_${i}_${run/+/_}.log" t0=$SECONDS
    # global batch 24 (not 16): a multiple of dp 3 x micro batch 2, so that 3 GPUs may run dp 3
    case $run in
      tp2xdp2)  # every optimizer shard held by both dp replicas: the survivors miss nothing
        flags=("${MODEL[@]}" --tensor-model-parallel-size 2 --num-distributed-optimizer-instances 2) ;;
      dp3+standby)  # plain data-parallel replicas (no distributed optimizer), rank 3 waiting
        for f in "${MODEL[@]}"; do [ "$f" = --use-distributed-optimizer ] || flags+=("$f"); done
        flags+=(--elastic-initial-members 3) ;;
      *) md "- unknown in-process run: $run (tp2xdp2, dp3+standby)"; continue ;;
    esac
    # NCCL's watchdog must leave up a process whose communicators the recovery aborts
    TORCH_NCCL_ASYNC_ERROR_HANDLING=0 timeout -s INT -k 20 "$(min "${INPROCESS_TIMEOUT:-150}" "$(left)")" \
      python3 tools/bench_recovery.py --in-process --nproc 4 --kill-after "$kill" --victim 1 \
      --port $((29450 + i)) --log "$log" -- "${flags[@]}" --global-batch-size 24 \
      --train-iters "$iters" --log-interval 1 \
      --elastic-control-port $((29650 + i)) --elastic-heartbeat-timeout 30 > "$log.json" 2> "$log.err" \
      || { echo "FAILED in-process run $i ($run)"; tail -n 5 "$log.err" "$log"; }
    echo "inprocess $i $run: $((SECONDS - t0)) s" | tee -a "$LOGS/times.txt"
    [ $((SECONDS - t0)) -gt "$est" ] && est=$((SECONDS - t0))
    keep_records "$log.json" "$i" "$run" inprocess
    save_logs
  done
  md_table "inprocess: kill -9 of rank 1 after iteration $kill of $iters, in-process recovery (python -m megadyn.launch --max-restarts 0)" inprocess << 'EOF'
def fields(line):  # the job's " elastic: ... event: failure | key: value | ..." line
    return {k: v.strip() for k, v in re.findall(r"(\w+): ([^|]+)", line or "")}
cols = [fields(r.get("job_recovery_line")) for r in rows]
print("| | " + " | ".join(f"run {r['run']}, {r['variant']}" for r in rows) + " |")
print("|---|" + "---|" * len(rows))
print("| **kill -> next completed step (s)** | " + " | ".join(f"**{r['kill_to_next_step_s']}**" for r in rows) + " |")
print("| layout | " + " | ".join(f"{c.get('old', '-')} -> {c.get('new', '-')}" for c in cols) + " |")
print("| killed after iteration | " + " | ".join(str(r.get("killed_after_iteration")) for r in rows) + " |")
keys = ["repeated", "from", "left", "detect_s", "abort_s", "agree_s", "plan_s", "move_s",
        "rebuild_s", "first_step_s", "total_s", "bytes_moved", "completed"]
names = {"repeated": "steps repeated", "total_s": "total_s (failure record -> first step done)"}
for k in keys:
    if any(k in c for c in cols):
        print(f"| {names.get(k, k)} | " + " | ".join(c.get(k, "-") for c in cols) + " |")
print("| exit code | " + " | ".join(str(r.get("exit_code")) for r in rows) + " |")
EOF
}

for p in "${PARTS[@]}"; do
  echo "== $p ($(left) s of BUDGET_S left)"
  if [ -n "${TODO[$p]:-}" ]; then
    md ""; md "## $p: not run, its code does not exist yet: ${TODO[$p]}"; continue
  fi
  "part_$p"
done
cp "$OUT/suite.md" "$LOGS/"; save_logs
cat "$OUT/suite.md"
