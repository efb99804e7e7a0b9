"""On a GPU machine (2 GPUs): one layer's document-masked attention (16 heads of 128) on one
32k sample of scripts/gpu/dcp_compare.sh, through the ring (--cp-placement static), dynamic cp
and the static split through dynamic's path (static_blocks): forward + backward time, a
torch.profiler kernel table of two iterations (rank 0), and each row's output and q, k, v
gradients, gathered to the whole sequence, against the ring's (bf16, relative norm).

    SAMPLE=1 torchrun --standalone --nproc-per-node 2 scripts/gpu/dcp_profile.py
(samples 0-2 are dcp_compare.sh's; its table gives the timings of record, this the breakdown)
"""

import os
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from megadyn.bench.documents import skewed_document_ids
from megadyn.core.context_parallel import dynamic_attention, ring_attention, split_sequence
from megadyn.core.context_parallel.placement import place_blocks
from megadyn.core.context_parallel.sequence import local_positions

SEQ, HEADS, HEAD_DIM, BLOCK, CP = 32768, 16, 128, 1024, 2


def row_attention(row: str, rank: int, ids: torch.Tensor, full: list):
    """(this rank's q, k, v leaves, their sequence positions, the attention call) of `row`."""
    if row == "ring":
        positions = local_positions(SEQ, rank, CP).cuda()
        mine = [split_sequence(t, rank, CP, dim=2).clone().requires_grad_() for t in full]
        ids_dev = ids.cuda()
        return mine, positions, lambda: ring_attention(*mine, dist.group.WORLD, None, ids_dev)
    placement = place_blocks(SEQ, BLOCK, CP, ids, balance=row == "dynamic")
    positions = placement.token_index(rank, "cuda")
    mine = [t[:, :, positions].clone().requires_grad_() for t in full]
    return mine, positions, lambda: dynamic_attention(*mine, dist.group.WORLD, placement)


def gathered(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Every rank's x [1, h, s, d] at its positions in the whole sequence (fp32)."""
    xs = [torch.empty_like(x) for _ in range(CP)]
    ps = [torch.empty_like(positions) for _ in range(CP)]
    dist.all_gather(xs, x.contiguous())
    dist.all_gather(ps, positions)
    whole = torch.empty(1, x.shape[1], SEQ, HEAD_DIM, device="cuda")
    for part, at in zip(xs, ps):
        whole[:, :, at] = part.float()
    return whole


def main() -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    sample = int(os.environ.get("SAMPLE", "1"))
    ids = skewed_document_ids(SEQ, torch.Generator().manual_seed(1000 + sample))[None]
    torch.manual_seed(0)
    full = [torch.randn(1, HEADS, SEQ, HEAD_DIM, device="cuda", dtype=torch.bfloat16)]
    full += [torch.randn_like(full[0]) for _ in range(2)]
    grad = torch.randn(full[0].shape, generator=torch.Generator("cuda").manual_seed(1),
                       device="cuda", dtype=torch.bfloat16)  # fmt: skip
    results = {}
    for row in ("ring", "dynamic", "static_blocks"):
        mine, positions, attention = row_attention(row, rank, ids, full)
        g = grad[:, :, positions].contiguous()
        out = attention()
        out.backward(g)
        results[row] = [gathered(t, positions) for t in [out.detach()] + [t.grad for t in mine]]
        for _ in range(3):
            attention().backward(g)
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(5):
            attention().backward(g)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / 5 * 1e3
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                attention().backward(g)
            torch.cuda.synchronize()
        if rank == 0:
            print(f"=== {row} sample {sample}: {ms:.2f} ms fwd+bwd", flush=True)
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14)
            print(table, flush=True)
    if rank == 0:
        for row in ("dynamic", "static_blocks"):
            errors = [((a - b).norm() / b.norm()).item() for a, b in zip(results[row], results["ring"])]  # fmt: skip
            print(f"{row} vs ring (out, dq, dk, dv) relative: {errors}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
