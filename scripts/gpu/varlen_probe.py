"""On a GPU machine (one GPU): torch's attention with cumulative lengths, as dynamic cp
(megadyn/core/context_parallel/varlen.py) calls it.

1. The causal mask aligned at each segment's end (a segment's queries are the last positions
   of its keys), against an fp32 reference: flash (`_flash_attention_forward`, which varlen.py
   uses) and cuDNN's ragged path (`_cudnn_attention_forward`: wrong and slow on torch 2.11,
   so varlen.py does not use it).
2. Forward + backward time of one cp rank's segments on scripts/gpu/dcp_compare.sh's three
   document-masked 32k samples, under the dynamic and the static block placements: one JSON
   line per (sample, placement, rank, kernel).

    python3 scripts/gpu/varlen_probe.py
"""

import json
import time

import torch

from megadyn.bench.documents import skewed_document_ids
from megadyn.core.context_parallel.placement import place_blocks
from megadyn.core.context_parallel.route import derive_route

aten = torch.ops.aten
SEQ, HEADS, HEAD_DIM, BLOCK = 32768, 16, 128, 1024


def cumulative(lengths) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32).cuda()


def call(kernel: str, q, k, v, q_len, k_len, backward: bool = False):
    """The kernel's output (and its backward with a gradient of ones)."""
    cq, ck, scale = cumulative(q_len), cumulative(k_len), q.shape[-1] ** -0.5
    if kernel == "flash":
        out, lse, rng, unused, _ = aten._flash_attention_forward(
            q, k, v, cq, ck, max(q_len), max(k_len), 0.0, True, False, scale=scale
        )
        if backward:
            aten._flash_attention_backward(torch.ones_like(out), q, k, v, out, lse, cq, ck,
                                           max(q_len), max(k_len), 0.0, True, rng, unused,
                                           scale=scale)  # fmt: skip
        return out
    res = aten._cudnn_attention_forward(
        q, k, v, None, cq, ck, max(q_len), max(k_len), True, 0.0, True, False, scale=scale
    )
    if backward:
        aten._cudnn_attention_backward(torch.ones_like(res[0]), q, k, v, res[0], res[1], res[6],
                                       res[7], None, cq, ck, max(q_len), max(k_len), 0.0, True,
                                       scale=scale)  # fmt: skip
    return res[0]


def reference(q, k, v, q_len, k_len) -> torch.Tensor:
    """fp32 attention of each segment, query j seeing keys up to j + lk - lq."""
    outs, a, b = [], 0, 0
    for lq, lk in zip(q_len, k_len):
        qq, kk, vv = (
            t.float().transpose(0, 1) for t in (q[a : a + lq], k[b : b + lk], v[b : b + lk])
        )
        scores = qq @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5
        rows = torch.arange(lq, device="cuda")[:, None] + (lk - lq)
        scores = scores.masked_fill(torch.arange(lk, device="cuda")[None] > rows, float("-inf"))
        outs.append((scores.softmax(-1) @ vv).transpose(0, 1))
        a, b = a + lq, b + lk
    return torch.cat(outs)


def check_masks() -> None:
    q_len, k_len, heads, d = [64, 100, 37], [192, 100, 300], 4, 64
    q = torch.randn(sum(q_len), heads, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(k_len), heads, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    ref = reference(q, k, v, q_len, k_len)
    for kernel in ("flash", "cudnn"):
        try:
            error = (call(kernel, q, k, v, q_len, k_len).float() - ref).abs().max().item()
            print(f"{kernel}: largest error against the end-aligned causal mask {error:.4f}")
        except RuntimeError as err:
            print(f"{kernel}: failed: {str(err)[:300]}")


def time_segments() -> None:
    for sample in range(3):
        ids = skewed_document_ids(SEQ, torch.Generator().manual_seed(1000 + sample))[None]
        for name, balance in (("dynamic", True), ("static_blocks", False)):
            placement = place_blocks(SEQ, BLOCK, 2, ids, balance=balance)
            for rank in range(2):
                route = derive_route(placement, rank, ids, 1, "cuda")
                parts = [p for p in route.parts if p is not None]
                q_len = [b - a for p in parts for a, b in zip(p.plan.cu_q, p.plan.cu_q[1:])]
                k_len = [b - a for p in parts for a, b in zip(p.plan.cu_k, p.plan.cu_k[1:])]
                bf16 = dict(device="cuda", dtype=torch.bfloat16)
                q = torch.randn(sum(q_len), HEADS, HEAD_DIM, **bf16)
                k, v = (torch.randn(sum(k_len), HEADS, HEAD_DIM, **bf16) for _ in "kv")
                ms = {}
                for kernel in ("flash", "cudnn"):
                    try:
                        for _ in range(3):
                            call(kernel, q, k, v, q_len, k_len, backward=True)
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        for _ in range(10):
                            call(kernel, q, k, v, q_len, k_len, backward=True)
                        torch.cuda.synchronize()
                        ms[kernel] = (time.perf_counter() - start) / 10 * 1e3
                    except RuntimeError as err:
                        ms[kernel] = str(err)[:200]
                work = sum(lq * lk - lq * (lq - 1) / 2 for lq, lk in zip(q_len, k_len))
                print(json.dumps(dict(sample=sample, placement=name, rank=rank,
                                      segments=len(q_len), queries=sum(q_len), keys=sum(k_len),
                                      work=work, fwd_bwd_ms=ms)), flush=True)  # fmt: skip


if __name__ == "__main__":
    torch.manual_seed(0)
    check_masks()
    time_segments()
