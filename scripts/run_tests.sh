#!/usr/bin/env bash
# megadyn's test suite on CPU (gloo, spawned processes). Sets up what it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=1
exec "${PYTHON:-python3}" -m pytest tests "$@"
