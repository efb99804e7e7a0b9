"""FP8 linear layers on a GPU: a correctness check, then an MLP block's forward + backward time.

    python -m megadyn.bench.fp8_linear [--hidden 2048 4096] [--tokens 4096] [--cuda-graph]

Check: on the GPU, each recipe's layer output and gradients against a quantize-dequantize
computation in fp32 (the same check the CPU tests make bit for bit; here the GEMM writes bf16,
so the difference is bf16 rounding), and the Triton tensorwise quantization against the same
math in torch operations (bit-equal fp8 bytes). Timing: fc1 (h -> 4h, column-parallel), GeLU,
fc2 (4h -> h, row-parallel), bf16 weights with an fp32 main_grad (the training path), per
recipe against bf16, and each tensorwise recipe with its weights quantized before (`+cached
weights`: a step's micro batches after its first, fp8_cache.py); with torchao installed also
torchao's Float8Linear (tensorwise), eager and compiled, on the same shapes. With --cuda-graph
megadyn's rows time replays of one captured forward + backward: the GPU's time, as a training
step under --cuda-graph runs it. One JSON line per result.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.nn.functional as F
from torch import nn

from megadyn.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megadyn.core.tensor_parallel.fp8 import FP8_MAX, Fp8Recipe, pow2_scale, quantize
from megadyn.core.tensor_parallel.fp8_cache import weights_fixed

RECIPES = {
    "e4m3/tensorwise": Fp8Recipe("e4m3"),
    "hybrid/tensorwise": Fp8Recipe("hybrid"),
    "e4m3/rowwise": Fp8Recipe("e4m3", "rowwise"),
}


def _dequantized(t, dtype, dim=None):
    t = t.float()
    amax = t.abs().amax() if dim is None else t.abs().amax(dim, keepdim=True)
    scale = pow2_scale(amax, FP8_MAX[dtype])
    return (t * scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype).float() / scale


def check(device) -> list[dict]:
    """Relative error of each recipe's y, dx, dW against fp32 on dequantized operands, and
    whether the Triton quantization gives the torch expression's bytes."""
    out = []
    gen = torch.Generator(device=device).manual_seed(0)
    t = torch.randn(4096, 2048, device=device, generator=gen).to(torch.bfloat16) * 3
    for dtype in FP8_MAX:
        q, inv, qt = quantize(t, dtype, None, transpose=True)
        scale = pow2_scale(t.abs().amax(), FP8_MAX[dtype])
        ref = (t.float() * scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
        same = torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
        out.append(dict(check="triton_quantize", dtype=str(dtype), bit_equal=same))
        out[-1]["inv_scale_equal"] = bool(inv == scale.reciprocal())
        out[-1]["transpose_equal"] = torch.equal(qt.view(torch.uint8), q.view(torch.uint8).t())
    for name, recipe in RECIPES.items():
        layer = ColumnParallelLinear(
            2048, 1024, None, bias=False, fp8=recipe, dtype=torch.bfloat16, device=device
        )
        with torch.no_grad():
            layer.weight.normal_(0, 0.02, generator=gen)
        layer.weight.main_grad = torch.zeros(1024, 2048, device=device)
        x = torch.randn(4096, 2048, device=device, generator=gen).to(torch.bfloat16)
        x.requires_grad_()
        g = torch.randn(4096, 1024, device=device, generator=gen).to(torch.bfloat16)
        y = layer(x)
        y.backward(g)
        w, fwd, bwd = layer.weight.detach(), recipe.forward_dtype, recipe.grad_dtype
        xd = x.detach()
        if recipe.recipe == "tensorwise":
            qx, qw, qg = _dequantized(xd, fwd), _dequantized(w, fwd), _dequantized(g, bwd)
            ry, rgx, rgw = qx @ qw.t(), qg @ qw, qg.t() @ qx
        else:
            ry = _dequantized(xd, fwd, 1) @ _dequantized(w, fwd, 1).t()
            rgx = _dequantized(g, bwd, 1) @ _dequantized(w, bwd, 0)
            rgw = _dequantized(g, bwd, 0).t() @ _dequantized(xd, fwd, 0)

        def rel(a, b):
            return round(((a.float() - b).norm() / b.norm()).item(), 6)

        out.append(
            dict(
                check="layer_vs_dequantized",
                recipe=name,
                y=rel(y.detach(), ry),
                dx=rel(x.grad, rgx),
                dw_main_grad=rel(layer.weight.main_grad, rgw),
            )
        )
    return out


class MegadynMLP(nn.Module):
    def __init__(self, h: int, recipe, device):
        super().__init__()
        kw = dict(bias=False, fp8=recipe, dtype=torch.bfloat16, device=device)
        self.fc1 = ColumnParallelLinear(h, 4 * h, None, **kw)
        self.fc2 = RowParallelLinear(4 * h, h, None, **kw)
        for p in self.parameters():
            nn.init.normal_(p, 0, 0.02)
            p.main_grad = torch.zeros(p.shape, device=device)
            p.register_post_accumulate_grad_hook(_drop_grad)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _drop_grad(param) -> None:
    """What the DDP hook does once a gradient is in `main_grad` (else autograd would add each
    call's placeholder into `.grad`, a bf16 add of every weight that training does not run)."""
    param.grad = None
    param.grad_added_to_main_grad = False


def torchao_mlp(h: int, device, compiled: bool):
    from torchao.float8 import convert_to_float8_training

    model = nn.Sequential(
        nn.Linear(h, 4 * h, bias=False), nn.GELU(), nn.Linear(4 * h, h, bias=False)
    ).to(device=device, dtype=torch.bfloat16)
    convert_to_float8_training(model)
    return torch.compile(model) if compiled else model


def time_ms(
    model, x, g, iters: int = 20, warmup: int = 5, cached: bool = False, graph: bool = False
) -> float:
    """Median ms of forward + backward; `cached`: all calls inside one weight-cache scope (the
    first warm-up call quantizes the weights, the timed calls reuse them); `graph`: replays of
    one CUDA graph of forward + backward (the GPU's time, without the host's launches)."""
    times = []
    with weights_fixed([model]) if cached else contextlib.nullcontext():
        step = lambda: model(x).backward(g)  # noqa: E731
        if graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                step()
            step = captured.replay
        for i in range(warmup + iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def bench(h: int, tokens: int, device, graph: bool = False) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, h, device=device, generator=gen).to(torch.bfloat16)
    g = torch.randn(tokens, h, device=device, generator=gen).to(torch.bfloat16)
    models = {"bf16": lambda: MegadynMLP(h, None, device)}
    models.update({n: (lambda r=r: MegadynMLP(h, r, device)) for n, r in RECIPES.items()})
    cached = {f"{n} +cached weights": n for n, r in RECIPES.items() if r.recipe == "tensorwise"}
    models.update({c: models[n] for c, n in cached.items()})
    try:
        import torchao  # noqa: F401

        models["torchao/tensorwise eager"] = lambda: torchao_mlp(h, device, False)
        models["torchao/tensorwise compiled"] = lambda: torchao_mlp(h, device, True)
    except ImportError:
        pass
    rows, base = [], None
    for name, make in models.items():
        ms = time_ms(make(), x, g, cached=name in cached, graph=graph and "torchao" not in name)
        base = base or ms
        rows.append(dict(bench="mlp_fwd_bwd", hidden=h, tokens=tokens, mode=name, ms=round(ms, 3)))
        rows[-1]["cuda_graph"] = graph and "torchao" not in name
        rows[-1]["speedup_vs_bf16"] = round(base / ms, 3)
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="time replays of a CUDA graph of forward + backward (torchao rows stay eager)",
    )
    a = p.parse_args()
    device = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for row in check(device):
        print(json.dumps(row), flush=True)
    for h in a.hidden:
        for row in bench(h, a.tokens, device, a.cuda_graph):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
