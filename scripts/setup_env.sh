#!/usr/bin/env bash
# Install megadyn and what it needs into the current Python (idempotent, quiet).
# On a machine without a GPU it takes the CPU build of torch; where torch is already present
# (a GPU machine), it is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
# Triton (test extra: the CPU tests run the fused cross entropy's kernels in its interpreter):
# the version torch 2.13's CUDA build pins; a GPU machine's torch comes with its own
if ! "$PY" -c "import triton" 2>/dev/null; then
  "$PY" -m pip install -q "triton==3.7.1"
fi
"$PY" -m pip install -q -e ".[test]"
