"""Time the attention kernels torch offers on this GPU: forward + backward of causal
scaled_dot_product_attention at the reference shape, one line per kernel.

    python -m megadyn.bench attention                      # b 2, heads 16, seq 2048, head dim 128
    python -m megadyn.bench attention --heads 8 --seq 4096
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args()
    shape = (a.batch, a.heads, a.seq, a.head_dim)
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    # causal attention's useful work: half of 4 b n s^2 d forward, 2.5x that backward
    flops = 0.5 * 4 * a.batch * a.heads * a.seq**2 * a.head_dim * 3.5
    ref = None
    for name, backend in [
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ]:
        try:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.backward(grad)
                dq = q.grad.clone()
                q.grad = k.grad = v.grad = None
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                for _ in range(a.iters):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
                end.record()
                torch.cuda.synchronize()
        except RuntimeError as e:
            print(f"{name:<10} unavailable: {str(e).splitlines()[0][:100]}")
            continue
        ms = start.elapsed_time(end) / a.iters
        ref = (out, dq) if ref is None else ref
        diff = max((out - ref[0]).abs().max().item(), (dq - ref[1]).abs().max().item())
        print(
            f"{name:<10} {ms:7.3f} ms fwd+bwd  {flops / ms / 1e9:6.1f} TFLOP/s  "
            f"max |diff| vs flash {diff:.2e}"
        )
        q.grad = k.grad = v.grad = None
    with torch.no_grad():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    print("torch's default kernel order picks:", torch._fused_sdp_choice(q, k, v, is_causal=True))


if __name__ == "__main__":
    main()
