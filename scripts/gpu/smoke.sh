#!/usr/bin/env bash
# The GPU gate (scripts/gpu/smoke.py): every path that only runs on GPUs, on a machine with 2
# GPUs, in under 8 minutes; one table (OUTDIR/table.md), one line appended to
# docs/gpu-checks.jsonl, OUTDIR/<check>.log and OUTDIR/logs.tgz. Exit 0 only if every check passed.
# Usage: bash scripts/gpu/smoke.sh OUTDIR [--only a,b] [--skip c] [--no-record] [--jobs N]
#        (SMOKE_ONLY / SMOKE_SKIP work as --only / --skip; --list names the checks)
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=4
exec python3 scripts/gpu/smoke.py "$@"
