#!/usr/bin/env bash
# On a GPU machine (2 GPUs), in one device call: context parallelism on the 1.42B reference model
# at long sequences against tp2, tp2 + SP and torch's own context parallelism, then the bf16
# losses of cp2 against cp1.
#   1. the ring's flash blocks against the whole attention on this GPU (tests/core/test_cp_kernels.py)
#   2. tools/bench_cp_compare.py: ROWS at SEQS, ROUNDS rounds in alternating order, micro batch 1,
#      TOKENS tokens per iteration, full recomputation from RECOMPUTE_FROM tokens; then EXTRA (the
#      longest lengths) while time is left. A run out of memory ends step 2.
#   3. pretrain_gpt.py, 8 layers, hidden 1024, seq 4096, 20 iterations: cp1 (1 GPU) vs cp2 with
#      --cp-comm-type p2p and a2a
# Writes OUTDIR/cp.jsonl (records), cp.md (table), losses.txt and the logs.
# Usage: BUDGET_S=330 bash scripts/gpu/cp_compare.sh OUTDIR
#   (on CPU, the flow only: MODEL_FLAGS="--layers 2 --hidden 64 --heads 4 --vocab 1024" SEQS=64
#    TOKENS=128 ROWS="cp2 tp2" EXTRA=cp2@128:full LOSSES=0 bash scripts/gpu/cp_compare.sh /tmp/c)
set -uo pipefail
OUT=${1:-/tmp/megadyn_cp}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
BUDGET_S=${BUDGET_S:-330}; LOSS_S=${LOSS_S:-70}  # seconds for the whole script, for step 3
SEQS=${SEQS:-"8192 16384 32768"}; ROWS=${ROWS:-"cp2 tp2 tp2_sp torch_cp2"}; ROUNDS=${ROUNDS:-2}
TOKENS=${TOKENS:-32768}; RECOMPUTE_FROM=${RECOMPUTE_FROM:-32768}
# without recomputation last: a run out of memory ends step 2
EXTRA=${EXTRA:-"cp2@65536:full torch_cp2@65536:full tp2_sp@65536:full cp2@32768 tp2@32768"}
left() { echo $((BUDGET_S - SECONDS)); }

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -m pytest -q -s tests/core/test_cp_kernels.py -k gpu 2>&1 | tail -4 | tee "$OUT/kernels.log"

rows_s=$(( $(left) - LOSS_S ))
# shellcheck disable=SC2086
timeout $((rows_s + 60)) torchrun --standalone --nproc-per-node 2 tools/bench_cp_compare.py \
  --out "$OUT/cp.jsonl" --seqs $SEQS --rows $ROWS --rounds "$ROUNDS" --tokens "$TOKENS" \
  --iters 3 --warmup 1 --budget-s "$rows_s" --recompute-from "$RECOMPUTE_FROM" --extra $EXTRA ${MODEL_FLAGS:-} > "$OUT/rows.log" 2>&1 \
  || { echo "rows: exit $? (see rows.log)"; grep -v '^{' "$OUT/rows.log" | tail -15; }
python3 tools/bench_cp_compare.py --summarize "$OUT/cp.jsonl" | tee "$OUT/cp.md"

COMMON=(--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 4096
  --max-position-embeddings 4096 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
  --micro-batch-size 1 --global-batch-size 8 --bf16 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 5
  --train-iters 20 --log-interval 1 --eval-interval 0 --num-workers 0 --hidden-dropout 0
  --attention-dropout 0 --seed 1234)
[ "${LOSSES:-1}" = 1 ] || exit 0
for run in "cp1 1" "cp2 2 --context-parallel-size 2" \
    "cp2_a2a 2 --context-parallel-size 2 --cp-comm-type a2a"; do
  set -- $run; name=$1 n=$2; shift 2
  rm -f "$OUT/$name.jsonl"
  [ "$(left)" -gt 15 ] || { echo "losses: no time left for $name"; continue; }
  timeout "$(left)" torchrun --standalone --nproc-per-node "$n" pretrain_gpt.py "${COMMON[@]}" "$@" \
    --metrics-file "$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1 || { echo "FAILED $name"; tail -5 "$OUT/$name.log"; }
done
# the largest relative difference of each cp2 run's losses from cp1's, first and last loss
[ -s "$OUT/cp1.jsonl" ] && (cd "$OUT" && ls cp2*.jsonl 2>/dev/null | xargs python3 "$OLDPWD/tools/compare_losses.py" cp1.jsonl) | tee "$OUT/losses.txt"
echo "cp_compare.sh: ${SECONDS}s"
