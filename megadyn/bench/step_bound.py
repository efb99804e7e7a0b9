"""How fast a training step could be on this GPU: the step's GEMMs and attention kernels timed
alone, back to back, with nothing between them (no norms, no communication, no optimizer).

    python -m megadyn.bench.step_bound --seq 32768 --tp 2          # one GPU's share under tp 2
    python -m megadyn.bench.step_bound --seq 32768 --cp 2          # one GPU's share under cp 2

One GPU's share of one micro batch of the GPT-2 block model (bench/gpt.py's shapes: hidden
h, ffn 4h, biases, untied output layer; --mbs samples): per layer the four linear layers'
forward GEMM, input-gradient GEMM and weight-gradient GEMM at that share's widths (tp splits
the weights, cp the tokens), the causal attention's forward and backward (cuDNN first, as the
model runs it; tp: its heads over the whole sequence, one call; cp: calls with the same work
as the balanced split's), and the output layer's three GEMMs. The sum is a lower bound on the
step: any layout on these GPUs that computes the same FLOPs takes at least this long, so per
sample

    bound tokens/s per GPU = seq / (gpus * sum / mbs),  bound MFU = FLOPs / (gpus * sum / mbs * peak)

caps what the layout can reach. One JSON line: every kernel's time, the sum and the bounds.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megadyn.models.config import GPTConfig
from megadyn.models.flops import model_flops_per_iteration


def _time_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _linear_ms(tokens: int, n_in: int, n_out: int, iters: int) -> float:
    """Forward (x W^T + b), input gradient (dy W) and weight gradient (dy^T x, added in fp32)."""
    x = torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16) * n_in**-0.5
    b = torch.zeros(n_out, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, n_out, device="cuda", dtype=torch.bfloat16)
    main_grad = torch.zeros(n_out, n_in, device="cuda", dtype=torch.float32)

    def run():
        F.linear(x, w, b)
        dy @ w
        main_grad.add_(dy.t() @ x)

    return _time_ms(run, iters)


def _attention_ms(
    heads: int, calls: list[tuple[int, int, bool]], head_dim: int, b: int, iters: int
):
    """Forward + backward of attention calls (queries, keys, causal) of `heads` heads and
    `b` samples."""
    tensors = []
    for sq, sk, causal in calls:
        q = torch.randn(b, heads, sq, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (
            torch.randn(b, heads, sk, head_dim, device="cuda", dtype=torch.bfloat16) for _ in "kv"
        )
        for t in (q, k, v):
            t.requires_grad_(True)
        tensors.append((q, k, v, causal, torch.randn_like(q)))

    def run():
        for q, k, v, causal, grad in tensors:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            torch.autograd.grad(out, (q, k, v), grad)

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        return _time_ms(run, iters)


def bound(a: argparse.Namespace) -> dict:
    h, s, gpus = a.hidden, a.seq, a.tp * a.cp
    tokens, d = a.mbs * s // a.cp, h // a.heads
    linears = {  # (inputs, outputs) of this GPU's share of each linear layer
        "qkv": (h, 3 * h // a.tp),
        "proj": (h // a.tp, h),
        "fc1": (h, 4 * h // a.tp),
        "fc2": (4 * h // a.tp, h),
    }
    times = {name: _linear_ms(tokens, i, o, a.iters) for name, (i, o) in linears.items()}
    heads = a.heads // a.tp
    if a.cp == 1:
        calls = [(s, s, True)]
    else:  # the balanced split's work: a causal square of 2 chunks and full blocks of the rest
        chunk = s // (2 * a.cp)
        calls = [(2 * chunk, 2 * chunk, True)] + [(chunk, 2 * chunk, False)] * (a.cp - 1)
    times["attention"] = _attention_ms(heads, calls, d, a.mbs, a.iters)
    layer = sum(times.values())
    vocab = a.vocab
    times["output_layer"] = _linear_ms(tokens, h, vocab // a.tp, a.iters)
    micro_ms = a.layers * layer + times["output_layer"]  # one micro batch of mbs samples
    step_ms = micro_ms / a.mbs  # per sample: an iteration of one sequence
    cfg = GPTConfig.gpt2(
        num_layers=a.layers,
        hidden_size=h,
        num_attention_heads=a.heads,
        ffn_hidden_size=4 * h,
        vocab_size=vocab,
        max_position_embeddings=s,
    )
    flops = model_flops_per_iteration(cfg, 1, s, a.tp)
    return dict(
        gpu=torch.cuda.get_device_name(),
        seq=s,
        tp=a.tp,
        cp=a.cp,
        mbs=a.mbs,
        kernels_ms={k: round(v, 3) for k, v in times.items()},
        layer_ms=round(layer, 3),
        micro_batch_ms=round(micro_ms, 2),
        step_ms_per_sample=round(step_ms, 2),
        bound_tokens_per_s_per_gpu=round(s / (gpus * step_ms / 1e3)),
        bound_mfu=round(flops / (gpus * step_ms / 1e3) / (a.peak_tflops * 1e12), 4),
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--mbs", type=int, default=1, help="samples per micro batch (GEMM sizes)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    print(json.dumps(bound(p.parse_args(argv))), flush=True)


if __name__ == "__main__":
    main()
