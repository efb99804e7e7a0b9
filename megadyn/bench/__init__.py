"""Benchmarks of megadyn's training step, live layout changes, recovery and data path, and the
tables and profiler-trace analysis they report; `python -m megadyn.bench NAME` runs one
(`--help` lists them; __main__.py). tools/bench_*.py are the command lines that scripts/gpu/
and the benchmark READMEs call. Current results are in BENCHMARKS.md."""


def run_gpt_tool(argv=None, description: str | None = None) -> None:
    """tools/bench_gpt.py: one record of the training step (gpt.py), printed by rank 0 as one
    JSON line (one process per rank, under torchrun)."""
    import json

    import torch.distributed as dist

    from megadyn.bench.gpt import parse_args, run_gpt_bench
    from megadyn.launch.distributed_init import init_distributed

    a = parse_args(argv, description=description)
    device = init_distributed()
    res = run_gpt_bench(a, device)
    if dist.get_rank() == 0:
        print(json.dumps(res), flush=True)
    dist.destroy_process_group()


def run_compare_tool(parse, main, summarize) -> None:
    """The command line of a comparison benchmark (tools/bench_cp_compare.py,
    tools/bench_dcp_compare.py): with --summarize print the table of a run, else run it in
    this process (one per rank, under torchrun)."""
    c = parse()
    if c.summarize:
        print(summarize(c.summarize))
        return
    import torch.distributed as dist

    from megadyn.launch.distributed_init import init_distributed

    device = init_distributed()
    main(c, device)
    dist.destroy_process_group()
