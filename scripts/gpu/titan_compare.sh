#!/usr/bin/env bash
# On a 2-GPU machine: megadyn (tools/bench_gpt.py) against torchtitan 0.2.2, and against
# Megatron-Core 0.19.2 where it can run the shape, on issue 40's Llama-3-style model
# (megadyn/bench/titan_compare.py: 16 layers, hidden 2048, 32 heads, 8 kv heads, ffn 8192, vocab
# 128256, untied, RoPE 5e5, RMSNorm, SwiGLU, no biases; seq 4096, micro batch 2, 8 sequences per
# GPU a step), rows 1 GPU bf16, 1 GPU fp8, 2 GPUs bf16, 2 GPUs fp8, every framework on every row,
# which one goes first alternating by round (the order reversed in even rounds); then
# OUTDIR/table.md and OUTDIR/summary.json (median over rounds, each round's ratio, peak memory
# allocated and reserved per row, why a run did not happen); the runs' logs in OUTDIR/logs.tgz,
# env.txt and results.jsonl beside them (5 files in all).
#   torchtitan: compiled; fp8 = float8 tensorwise (output layer kept in bf16); under FSDP (2 GPUs)
#   also its float8 all-gather and precomputed scales. megadyn: --cuda-graph; fp8 = hybrid tensorwise.
#   Megatron-Core (opt-in, MCORE_ROWS): scripts/gpu/mcore_llama_bench.py, its GPTModel with the local
#   spec (no Transformer Engine, no apex: torch.nn.RMSNorm, jit-fused SwiGLU, SDPA attention with
#   cuDNN first on Hopper), DDP + distributed optimizer with overlapped grad reduce-scatter and
#   param all-gather at dp 2; bf16 only: its fp8 rows read "n/a: needs Transformer Engine".
# Usage, in the repository root of the GPU machine (carry .bench and .whl_tt; .whl too for
# Megatron-Core):
#   bash scripts/gpu/titan_compare.sh OUTDIR
#   MCORE_ROWS="1gpu_bf16 2gpu_bf16" ONLY="1gpu_bf16 2gpu_bf16" bash scripts/gpu/titan_compare.sh OUTDIR
# Once, on the CPU machine (copies the torchtitan harness of ../shared/bench/titan to .bench/titan
# and downloads its wheels into .whl_tt, both git-ignored; the megatron-core wheel into .whl, as
# BENCHMARKS.md's "How to run"):
#   bash scripts/gpu/titan_compare.sh --prepare
# ROUNDS (1) rounds; BUDGET_S (500) seconds after which no run starts and a running one is
# stopped, so the whole command fits in 9 minutes; ROW_TIMEOUT (240) stops one hung run;
# ONLY="1gpu_bf16 2gpu_fp8" picks rows; MCORE_ROWS (empty: none) the rows Megatron-Core runs too
# (its fp8 rows are n/a; a Megatron-Core run is estimated at 40-60 s, start-up and its first
# step's compile included, so four rows of three frameworks may not fit BUDGET_S: the two bf16
# rows with ONLY="1gpu_bf16 2gpu_bf16" are six runs); TT_STEPS (12, the first TT_WARMUP=4 untimed) and
# MG_ITERS (8, after 3 warm-up steps) the steps of each megadyn and Megatron-Core run;
# TITAN_DIR (.bench/titan, else ../shared/bench/titan) the harness; TT_WHEELS (.whl_tt) its
# wheels; TT_ATTN=flex tries torchtitan's flex attention; MEGADYN_ARGS adds flags to every
# megadyn run, MCORE_ARGS to every Megatron-Core run (e.g. --no-overlap-param-gather);
# DRY_RUN=1 prints the commands only; NGPU, TT_OK and MCORE_OK (0/1) override what the script
# detects (the GPUs, whether torchtitan imports, whether Megatron-Core imports or installs).
set -uo pipefail
TT_VERSIONS="torchtitan==0.2.2 torchao==0.18.0 torchdata==0.11.0 tyro==1.0.17 docstring_parser typeguard typing_extensions"
if [ "${1:-}" = --prepare ]; then
  src=${TITAN_SRC:-../shared/bench/titan}
  mkdir -p .bench && rm -rf .bench/titan && cp -r "$src" .bench/titan && chmod -R u+w .bench/titan
  exclude=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree
  for d in /.bench/ /.whl_tt/ /.whl/; do grep -qx "$d" "$exclude" || echo "$d" >> "$exclude"; done
  ls .whl_tt/torchtitan-*.whl > /dev/null 2>&1 || python3 -m pip download --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 -d .whl_tt $TT_VERSIONS
  ls .whl/megatron_core-*.whl > /dev/null 2>&1 || python3 -m pip download --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.19.2
  exit
fi
OUT=${1:?usage: titan_compare.sh OUTDIR}; mkdir -p "$OUT"; LOGS=$(mktemp -d)  # logs: OUT/logs.tgz
ROUNDS=${ROUNDS:-1}; BUDGET_S=${BUDGET_S:-500}; DRY_RUN=${DRY_RUN:-0}; start=$SECONDS
ONLY=${ONLY:-"1gpu_bf16 1gpu_fp8 2gpu_bf16 2gpu_fp8"}; MEGADYN_ARGS=${MEGADYN_ARGS:-}
MCORE_ROWS=${MCORE_ROWS:-}; MCORE_ARGS=${MCORE_ARGS:-}; MCORE_SCRIPT=scripts/gpu/mcore_llama_bench.py
MCORE_WHY="Megatron-Core: MCORE_OK=0 given"
TT_STEPS=${TT_STEPS:-12}; TT_WARMUP=${TT_WARMUP:-4}; MG_ITERS=${MG_ITERS:-8}; ROW_TIMEOUT=${ROW_TIMEOUT:-240}
TITAN_DIR=${TITAN_DIR:-.bench/titan}; [ -d "$TITAN_DIR" ] || TITAN_DIR=../shared/bench/titan
TT_WHEELS=${TT_WHEELS:-.whl_tt}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

TT_ARGS=(--model.name llama3_bench --model.flavor bench --training.seq_len 4096
  --training.local_batch_size 2 --training.steps "$TT_STEPS" --activation_checkpoint.mode none
  --checkpoint.no-enable --metrics.log_freq 1 --compile.enable --lr_scheduler.warmup_steps 2
  --job.dump_folder /tmp/tt_out)
TT_FP8=(--model.converters quantize.linear.float8 --quantize.linear.float8.filter_fqns output)
# one GPU names the tensorwise recipe; under FSDP torchtitan refuses a recipe name beside the
# float8 all-gather, which is tensorwise scaling itself
TT_RECIPE=(--quantize.linear.float8.recipe_name tensorwise)
TT_FSDP_FP8=(--quantize.linear.float8.enable_fsdp_float8_all_gather
  --quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp)

if [ "$DRY_RUN" = 1 ]; then NGPU=2 TT_OK=1 MCORE_OK=1; else
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$TT_WHEELS"/*.whl \
      || echo "torchtitan: wheel install from $TT_WHEELS failed (bash scripts/gpu/titan_compare.sh --prepare)"
    PYTHONPATH=/tmp/site python3 -c "from importlib.metadata import version as v; print('torchtitan', v('torchtitan'), 'torchao', v('torchao'))"
    echo "harness: $TITAN_DIR"
  } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
  # titan_bench imports torchtitan's llama3 package, which needs tt_shim's stand-in `datasets`
  PYTHONPATH=/tmp/site:$TITAN_DIR:$TITAN_DIR/tt_shim python3 -c "import torchtitan, torchao, titan_bench" >> "$OUT/env.txt" 2>&1 \
    && TT_OK=${TT_OK:-1} || TT_OK=${TT_OK:-0}
  NGPU=${NGPU:-$(python3 -c "import torch; print(torch.cuda.device_count())" 2> /dev/null || echo 0)}
  if [ -n "$MCORE_ROWS" ] && [ -z "${MCORE_OK:-}" ]; then
    # a subshell: mcore_ready's /tmp/site on PYTHONPATH stays out of the other frameworks' runs
    source scripts/gpu/mcore.sh
    MCORE_WHY=$(mcore_ready "$LOGS" "$MCORE_SCRIPT") && MCORE_OK=1 || MCORE_OK=0
    MCORE_WHY=${MCORE_WHY%%: its rows are skipped}; MCORE_WHY=${MCORE_WHY//$LOGS\/pip.log/pip.log in logs.tgz}
    { echo "${MCORE_WHY:-Megatron-Core: imports}"
      PYTHONPATH=$PYTHONPATH:/tmp/site python3 -c "from importlib.metadata import version as v; print('megatron-core', v('megatron-core'))" 2> /dev/null
    } >> "$OUT/env.txt"
  fi
  MCORE_OK=${MCORE_OK:-0}
fi

skip() {  # skip FRAMEWORK ROW ROUND WHY: says so, and a line for the table in results.jsonl
  echo "skipped ($4): $1 $2 round $3"
  [ "$DRY_RUN" = 1 ] && return
  printf '{"row": "%s", "round": %s, "framework": "%s", "skipped": "%s"}\n' "$2" "$3" "$1" \
    "$(tr -d '"\\' <<< "$4")" >> "$OUT/results.jsonl"
}

run() {  # run FRAMEWORK ROW ROUND: one run, its JSON line into results.jsonl
  local fw=$1 row=$2 round=$3 np=${2%%gpu_*} log="$LOGS/${1}_${2}_r${3}.log" left cmd margs vars
  if [ "$fw" = megatron-core ]; then
    if [[ $row == *fp8 ]]; then skip "$fw" "$row" "$round" "n/a: needs Transformer Engine"; return; fi
    if [[ " $MCORE_ROWS " != *" $row "* ]]; then skip "$fw" "$row" "$round" "not in MCORE_ROWS"; return; fi
    if [ "$MCORE_OK" = 0 ]; then skip "$fw" "$row" "$round" "not ready: ${MCORE_WHY#Megatron-Core: }"; return; fi
  fi
  left=$((BUDGET_S - (SECONDS - start)))
  if [ "$left" -lt 30 ]; then skip "$fw" "$row" "$round" budget; return; fi
  [ "$left" -gt "$ROW_TIMEOUT" ] && left=$ROW_TIMEOUT
  if [ "$np" -gt "$NGPU" ]; then skip "$fw" "$row" "$round" "$NGPU GPU"; return; fi
  if [ "$fw" = torchtitan ] && [ "$TT_OK" = 0 ]; then skip "$fw" "$row" "$round" "torchtitan does not import, see env.txt"; return; fi
  if [ "$fw" = megadyn ]; then
    read -ra margs <<< "$(python3 -m megadyn.bench titan_compare megadyn-args "$row")"
    [ "${#margs[@]}" -gt 0 ] || { echo "no megadyn flags for $row (python -m megadyn.bench titan_compare)"; return; }
    margs+=($MEGADYN_ARGS)
    cmd=(torchrun --standalone --nproc-per-node "$np" tools/bench_gpt.py "${margs[@]}"
      --iters "$MG_ITERS" --warmup 3)
    vars=()
  elif [ "$fw" = megatron-core ]; then
    read -ra margs <<< "$(python3 -m megadyn.bench titan_compare mcore-args "$row")"
    [ "${#margs[@]}" -gt 0 ] || { echo "no Megatron-Core flags for $row (python -m megadyn.bench titan_compare)"; return; }
    margs+=($MCORE_ARGS)
    cmd=(torchrun --standalone --nproc-per-node "$np" "$MCORE_SCRIPT" "${margs[@]}"
      --iters "$MG_ITERS" --warmup 3)
    vars=(PYTHONPATH="$PYTHONPATH:/tmp/site")
  else
    cmd=(torchrun --standalone --nproc-per-node "$np" "$TITAN_DIR/tt_run.py" "${TT_ARGS[@]}"
      --training.global_batch_size $((8 * np)))
    [[ $row == *fp8 ]] && cmd+=("${TT_FP8[@]}")
    [[ $row == *fp8 && $np = 1 ]] && cmd+=("${TT_RECIPE[@]}")
    [[ $row == *fp8 && $np -gt 1 ]] && cmd+=("${TT_FSDP_FP8[@]}")
    vars=(PYTHONPATH="/tmp/site:$TITAN_DIR:$TITAN_DIR/tt_shim:$PYTHONPATH" TT_WARMUP="$TT_WARMUP"
      TT_ATTN="${TT_ATTN:-sdpa}")
  fi
  echo "=== $fw $row round $round (t=$((SECONDS - start)) s): ${vars[*]} ${cmd[*]}"
  [ "$DRY_RUN" = 1 ] && return
  local t0=$SECONDS rc=0 before
  before=$(wc -l < "$OUT/results.jsonl")
  timeout -k 10 "$left" env "${vars[@]}" "${cmd[@]}" > "$log" 2>&1 || { rc=$?; tail -15 "$log"; }
  sed -n -e 's/^BENCH_JSON //p' -e t -e '/^{/p' "$log" \
    | sed "s/^{/{\"row\": \"$row\", \"round\": $round, \"wall_s\": $((SECONDS - t0)), /" >> "$OUT/results.jsonl"
  [ "$(wc -l < "$OUT/results.jsonl")" = "$before" ] \
    && skip "$fw" "$row" "$round" "failed (exit $rc after $((SECONDS - t0)) s, log in logs.tgz)"
  grep -h '"tokens_per_s_per_gpu' "$log" | grep -o '"tokens_per_s_per_gpu": [0-9.]*'
  tar czf "$OUT/logs.tgz" -C "$LOGS" .
}

: > "$OUT/results.jsonl"
for round in $(seq 1 "$ROUNDS"); do
  order="megadyn torchtitan"; [ -n "$MCORE_ROWS" ] && order+=" megatron-core"
  [ $((round % 2)) = 0 ] && order=$(tr ' ' '\n' <<< "$order" | tac | tr '\n' ' ')
  for row in $ONLY; do
    for fw in $order; do run "$fw" "$row" "$round"; done
  done
done
[ "$DRY_RUN" = 1 ] && exit
python3 -m megadyn.bench titan_compare summarize "$OUT/results.jsonl" --json "$OUT/summary.json" | tee "$OUT/table.md"
echo "total $((SECONDS - start)) s"
