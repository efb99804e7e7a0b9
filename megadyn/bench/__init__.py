"""Benchmarks of megadyn's training step and live layout changes, and the profiler-trace
analysis they report; tools/bench_gpt.py, tools/bench_reshard.py and tools/trace_overlap.py
are their command lines. Results and their history are in BENCHMARKS.md."""


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
