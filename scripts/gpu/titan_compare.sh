#!/usr/bin/env bash
# On a 2-GPU machine: megadyn (tools/bench_gpt.py) against torchtitan 0.2.2 on issue 40's
# Llama-3-style model (megadyn/bench/titan_compare.py: 16 layers, hidden 2048, 32 heads, 8 kv
# heads, ffn 8192, vocab 128256, untied, RoPE 5e5, RMSNorm, SwiGLU, no biases; seq 4096, micro
# batch 2, 8 sequences per GPU a step), rows 1 GPU bf16, 1 GPU fp8, 2 GPUs bf16, 2 GPUs fp8, both
# frameworks on every row, which one goes first alternating by round; then OUTDIR/table.md and
# OUTDIR/summary.json (median over rounds, each round's ratio, peak memory per row); the runs'
# logs in OUTDIR/logs.tgz, env.txt and results.jsonl beside them (5 files in all).
#   torchtitan: compiled; fp8 = float8 tensorwise (output layer kept in bf16); under FSDP (2 GPUs)
#   also its float8 all-gather and precomputed scales. megadyn: --cuda-graph; fp8 = hybrid tensorwise.
# Usage, in the repository root of the GPU machine (carry .bench and .whl_tt):
#   bash scripts/gpu/titan_compare.sh OUTDIR
# Once, on the CPU machine (copies the torchtitan harness of ../shared/bench/titan to .bench/titan
# and downloads its wheels into .whl_tt, both git-ignored):
#   bash scripts/gpu/titan_compare.sh --prepare
# ROUNDS (1) rounds; BUDGET_S (500) seconds after which no run starts and a running one is
# stopped, so the whole command fits in 9 minutes; ROW_TIMEOUT (240) stops one hung run;
# ONLY="1gpu_bf16 2gpu_fp8" picks rows; TT_STEPS (12, the first TT_WARMUP=4 untimed) and
# MG_ITERS (8, after 3 warm-up steps) the steps of each run;
# TITAN_DIR (.bench/titan, else ../shared/bench/titan) the harness; TT_WHEELS (.whl_tt) its
# wheels; TT_ATTN=flex tries torchtitan's flex attention; MEGADYN_ARGS adds flags to every
# megadyn run; DRY_RUN=1 prints the commands only; NGPU and TT_OK (0/1) override what the
# script detects (the GPUs, whether torchtitan imports).
set -uo pipefail
TT_VERSIONS="torchtitan==0.2.2 torchao==0.18.0 torchdata==0.11.0 tyro==1.0.17 docstring_parser typeguard typing_extensions"
if [ "${1:-}" = --prepare ]; then
  src=${TITAN_SRC:-../shared/bench/titan}
  mkdir -p .bench && rm -rf .bench/titan && cp -r "$src" .bench/titan && chmod -R u+w .bench/titan
  for d in /.bench/ /.whl_tt/; do grep -qx "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
  ls .whl_tt/torchtitan-*.whl > /dev/null 2>&1 || python3 -m pip download --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 -d .whl_tt $TT_VERSIONS
  exit
fi
OUT=${1:?usage: titan_compare.sh OUTDIR}; mkdir -p "$OUT"; LOGS=$(mktemp -d)  # logs: OUT/logs.tgz
ROUNDS=${ROUNDS:-1}; BUDGET_S=${BUDGET_S:-500}; DRY_RUN=${DRY_RUN:-0}; start=$SECONDS
ONLY=${ONLY:-"1gpu_bf16 1gpu_fp8 2gpu_bf16 2gpu_fp8"}; MEGADYN_ARGS=${MEGADYN_ARGS:-}
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

if [ "$DRY_RUN" = 1 ]; then NGPU=2 TT_OK=1; else
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
fi

run() {  # run FRAMEWORK ROW ROUND: one run, its JSON line into results.jsonl
  local fw=$1 row=$2 round=$3 np=${2%%gpu_*} log="$LOGS/${1}_${2}_r${3}.log" left cmd margs vars
  left=$((BUDGET_S - (SECONDS - start)))
  if [ "$left" -lt 30 ]; then echo "skipped (budget): $fw $row round $round"; return; fi
  [ "$left" -gt "$ROW_TIMEOUT" ] && left=$ROW_TIMEOUT
  if [ "$np" -gt "$NGPU" ]; then echo "skipped ($NGPU GPU): $fw $row"; return; fi
  if [ "$fw" = torchtitan ] && [ "$TT_OK" = 0 ]; then echo "skipped (torchtitan does not import, see env.txt): $row"; return; fi
  if [ "$fw" = megadyn ]; then
    read -ra margs <<< "$(python3 -m megadyn.bench titan_compare megadyn-args "$row")"
    [ "${#margs[@]}" -gt 0 ] || { echo "no megadyn flags for $row (python -m megadyn.bench titan_compare)"; return; }
    margs+=($MEGADYN_ARGS)
    cmd=(torchrun --standalone --nproc-per-node "$np" tools/bench_gpt.py "${margs[@]}"
      --iters "$MG_ITERS" --warmup 3)
    vars=()
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
  local t0=$SECONDS
  timeout -k 10 "$left" env "${vars[@]}" "${cmd[@]}" > "$log" 2>&1 || tail -15 "$log"
  sed -n -e 's/^BENCH_JSON //p' -e t -e '/^{/p' "$log" \
    | sed "s/^{/{\"row\": \"$row\", \"round\": $round, \"wall_s\": $((SECONDS - t0)), /" >> "$OUT/results.jsonl"
  grep -h '"tokens_per_s_per_gpu' "$log" | grep -o '"tokens_per_s_per_gpu": [0-9.]*'
  tar czf "$OUT/logs.tgz" -C "$LOGS" .
}

: > "$OUT/results.jsonl"
for round in $(seq 1 "$ROUNDS"); do
  order="megadyn torchtitan"; [ $((round % 2)) = 0 ] && order="torchtitan megadyn"
  for row in $ONLY; do
    for fw in $order; do run "$fw" "$row" "$round"; done
  done
done
[ "$DRY_RUN" = 1 ] && exit
python3 -m megadyn.bench titan_compare summarize "$OUT/results.jsonl" --json "$OUT/summary.json" | tee "$OUT/table.md"
echo "total $((SECONDS - start)) s"
