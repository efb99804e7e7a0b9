# Sourced by the GPU scripts that run Megatron-Core's reference benchmark beside megadyn's:
#   mcore_ready LOGDIR [SCRIPT]   true when SCRIPT (.bench/mcore_gpt_bench.py; titan_compare.sh
#                        names the tracked scripts/gpu/mcore_llama_bench.py) can run: Megatron-Core
#                        imports, or is installed now from the carried .whl/ into /tmp/site (pip's
#                        output in LOGDIR/pip.log); else one line on stdout saying what is missing.
# /tmp/site goes on PYTHONPATH (it outlives a call on a machine kept warm). See BENCHMARKS.md,
# "How to run", for how .whl/ and .bench/ are made here.
mcore_ready() {
  local why script=${2:-.bench/mcore_gpt_bench.py}
  [[ ":${PYTHONPATH:-}:" == *:/tmp/site:* ]] || export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
  if [ ! -f "$script" ]; then why="$script missing"
  elif python3 -c "import megatron.core" 2> /dev/null; then return 0
  elif ! ls .whl/*.whl > /dev/null 2>&1; then why=".whl/ (the megatron-core wheel) missing"
  elif python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > "$1/pip.log" 2>&1; then return 0
  else why="pip install of .whl/ failed (see $1/pip.log)"
  fi
  echo "Megatron-Core: $why (BENCHMARKS.md, How to run): its rows are skipped"
  return 1
}
