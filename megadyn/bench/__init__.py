"""Benchmarks of megadyn's training step and live layout changes, and the profiler-trace
analysis they report; tools/bench_gpt.py, tools/bench_reshard.py and tools/trace_overlap.py
are their command lines. Results and their history are in BENCHMARKS.md."""
