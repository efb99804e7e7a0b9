"""`python -m megadyn.bench NAME [flags]`: run one of megadyn's benchmarks (`--help` lists them).

    python -m megadyn.bench --help
    torchrun --nproc-per-node 2 -m megadyn.bench gpt --tp 2          # = tools/bench_gpt.py --tp 2
    python -m megadyn.bench titan_compare summarize OUT/results.jsonl

NAME's own flags follow it (`python -m megadyn.bench gpt --help`). The benchmarks that run one
process per rank are started under torchrun, as their tools/bench_*.py command lines are.
"""

from __future__ import annotations

import importlib
import sys

from megadyn.bench import run_compare_tool

BENCHMARKS = {  # name: (module:function called with sys.argv set to NAME's flags, or a module
    # with parse / main / summarize for run_compare_tool; what it measures)
    "gpt": ("megadyn.bench:run_gpt_tool", "the training step on the reference or a Llama shape (torchrun; JSON line)"),
    "table": ("megadyn.bench.table:main", "megadyn against Megatron-Core: the table of bench_compare.sh's results"),
    "titan_compare": ("megadyn.bench.titan_compare:main", "megadyn against torchtitan: rows and table (scripts/gpu/titan_compare.sh)"),
    "cp_compare": ("megadyn.bench.cp_compare", "context against tensor parallelism at long sequences (torchrun)"),
    "dcp_compare": ("megadyn.bench.dcp_compare", "dynamic against static context parallelism on documents (torchrun)"),
    "reshard": ("megadyn.bench.reshard:main", "live layout changes against the checkpoint path (torchrun)"),
    "hot_switch": ("megadyn.bench.hot_switch:main", "a hot switch's moves: all-gather path against the reshard executor (torchrun)"),
    "hetero": ("megadyn.bench.hetero:main", "replicas of different pipeline depth against grids (starts torchrun jobs)"),
    "recovery": ("megadyn.bench.recovery:main", "kill a worker, time kill -> next completed step (starts a torchrun job)"),
    "startup": ("megadyn.bench.startup:main", "what a fresh training process pays once, by component"),
    "attention": ("megadyn.bench.attention:main", "the attention kernels torch offers on this GPU"),
    "collectives": ("megadyn.bench.collectives:main", "tensor-parallel collectives of the reference shape (torchrun)"),
    "data_pipeline": ("megadyn.bench.data_pipeline:main", "preprocessing throughput and the loader's micro batches per second"),
    "fp8_linear": ("megadyn.bench.fp8_linear:main", "FP8 linear layers against bf16 and torchao"),
    "step_bound": ("megadyn.bench.step_bound:main", "the step's GEMMs and attention kernels timed alone"),
    "adam": ("megadyn.bench.adam:main", "the optimizer's update: torch's fused AdamW + cast against main params as remainders"),
    "trace_overlap": ("megadyn.bench.trace_overlap:main", "how much communication of a profiler trace ran beside compute"),
}  # fmt: skip


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    rows = [f"  {name:<{width}}  {what}" for name, (_, what) in BENCHMARKS.items()]
    return "usage: python -m megadyn.bench NAME [flags]\n\nbenchmarks:\n" + "\n".join(rows)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, flags = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"python -m megadyn.bench: no benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, _, function = BENCHMARKS[name][0].partition(":")
    sys.argv = [f"python -m megadyn.bench {name}", *flags]  # NAME's parser reads its flags here
    m = importlib.import_module(module)
    if not function:
        return run_compare_tool(m.parse, m.main, m.summarize) or 0
    return getattr(m, function)() or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
