"""Time the tensor-parallel collectives of the reference shape on this machine's GPUs.

    torchrun --nproc-per-node 2 -m megadyn.bench collectives   # [s, b, h] = [2048, 2, 2048] bf16

NCCL all-reduce of [s, b, h] (plain tensor parallelism), all-gather and reduce-scatter to and
from [s/tp, b, h] (sequence parallelism), and a column-parallel GEMM (fc1) alone, after its
all-gather, and fused with it by torch's symmetric-memory op. Prints microseconds per call
(mean over `--iters`, CUDA events) on rank 0. BENCHMARKS.md reads these to explain why
sequence parallelism costs more communication than plain tensor parallelism here.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from megadyn.core import c10d_compat


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    tp, g = dist.get_world_size(), dist.group.WORLD
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    full = torch.randn(a.seq, a.batch, a.hidden, **bf16)
    part = torch.randn(a.seq // tp, a.batch, a.hidden, **bf16)
    out_full, out_part = torch.empty_like(full), torch.empty_like(part)
    w = torch.randn(a.ffn // tp, a.hidden, **bf16)

    def gather_then_gemm():
        dist.all_gather_into_tensor(out_full, part)
        return out_full @ w.t()

    rows = [
        ("all-reduce [s, b, h]", lambda: dist.all_reduce(full)),
        ("all-gather [s/tp, b, h]", lambda: dist.all_gather_into_tensor(out_full, part)),
        ("reduce-scatter [s, b, h]", lambda: dist.reduce_scatter_tensor(out_part, full)),
        ("fc1 GEMM alone", lambda: full @ w.t()),
        ("fc1 all-gather then GEMM", gather_then_gemm),
    ]
    try:  # TorchChanged is a RuntimeError
        c10d_compat.symmetric_memory().enable_symm_mem_for_group(g.group_name)
        fused = torch.ops.symm_mem.fused_all_gather_matmul
        rows.append(("fc1 fused all-gather GEMM", lambda: fused(part, [w.t()], 0, g.group_name)))
    except (AttributeError, RuntimeError) as e:
        print(f"symmetric memory unavailable: {e}")
    times = [(name, timed(fn, a.iters)) for name, fn in rows]
    if dist.get_rank() == 0:
        size = full.numel() * full.element_size() / 1e6
        print(f"tp {tp}, [s, b, h] = {list(full.shape)} bf16 = {size:.1f} MB")
        for name, us in times:
            print(f"{name:<30} {us:9.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
