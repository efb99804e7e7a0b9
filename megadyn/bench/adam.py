"""The optimizer step's update alone: torch's fused AdamW on fp32 main copies and their cast into
the bf16 weights, against the one-pass update of main params kept as remainders
(megadyn/core/optimizer/adam_kernels.py, --use-precision-aware-optimizer).

    python -m megadyn.bench adam --numel 1.5e9

One JSON line: milliseconds per step of each (median of --iters after --warmup), GB/s by the
bytes each must move, the bytes each keeps per element, and how many elements of the kernel's
result differ from the torch reference on the same inputs (the bits on the GPU: division and
square root are IEEE-rounded, a multiply-add may be contracted).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from megadyn.core.optimizer.adam_kernels import adamw_remainders_, reference_
from megadyn.core.optimizer.remainders import join, split

HYPER = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _time(fn, iters: int, warmup: int) -> float:
    times = []
    for i in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i + 1)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=float, default=1.5e9)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    n, dev = int(args.numel), torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    grad = torch.randn(n, device=dev, generator=gen) * 1e-2
    out = {"numel": n}

    out["torch_fused_ms"] = round(_torch_fused(n, grad, gen, args.iters, args.warmup), 3)
    torch.cuda.empty_cache()

    weight, remainder = split(torch.randn(n, device=dev, generator=gen) * 0.02)
    m, v = torch.zeros(n, device=dev), torch.zeros(n, device=dev)

    def kernel_step(step):
        adamw_remainders_(weight, remainder, grad, m, v, step=step, **HYPER)

    out["remainders_ms"] = round(_time(kernel_step, args.iters, args.warmup), 3)
    for key, moved in (("torch_fused_ms", 34), ("remainders_ms", 28)):
        out[key.replace("_ms", "_gbs")] = round(moved * n / out[key] / 1e6, 1)
    out["kept_bytes_per_element"] = {"torch_fused": 18, "remainders": 16}

    k = min(n, 1 << 22)  # the bits: the kernel against the reference, from the same state
    state = [t[:k].clone() for t in (weight, remainder, m, v)]
    ref = [t.cpu() for t in state]
    adamw_remainders_(state[0], state[1], grad[:k], state[2], state[3], step=9, **HYPER)
    reference_(ref[0], ref[1], grad[:k].cpu(), ref[2], ref[3], step=9, **HYPER)
    got, want = join(state[0], state[1]).cpu(), join(ref[0], ref[1])
    out["differing_of"] = [int((got != want).sum()), k]
    out["max_abs_diff"] = float((got - want).abs().max())
    print(json.dumps(out), flush=True)


def _torch_fused(n: int, grad, gen, iters: int, warmup: int) -> float:
    """Milliseconds of torch's fused AdamW on an fp32 main copy and the cast into bf16."""
    main_copy = torch.randn(n, device=grad.device, generator=gen) * 0.02
    weight = main_copy.to(torch.bfloat16)
    adam = torch.optim.AdamW([main_copy], **_torch_hyper(), fused=True)
    main_copy.grad = grad

    def step(_):
        adam.step()
        weight.copy_(main_copy)

    return _time(step, iters, warmup)


def _torch_hyper() -> dict:
    return dict(lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                weight_decay=HYPER["weight_decay"])  # fmt: skip


if __name__ == "__main__":
    main()
