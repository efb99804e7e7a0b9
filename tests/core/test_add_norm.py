"""The fused residual add + norm (Triton) equals torch's x + a followed by layer_norm / rms_norm:
both outputs, the gradients of x, a, weight and bias; and a transformer layer with its fused
kernels (add + norm, bias-GeLU) equals the plain layer.

The kernels run on CPU tensors under Triton's interpreter, switched on before triton is
imported: every check runs in spawned processes started with TRITON_INTERPRET=1. Row widths
that are no power of two exercise the masks; more rows than backward programs make a program
walk several rows, and a row count no multiple of them leaves the last program rows past the end.
"""

import dataclasses
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.core.triton_helpers import (
    assert_close_scaled,
    compiled,
    gradients,
    interpreted,
    uninterpreted,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (scripts/setup_env.sh installs it)",
)

SHAPES = ((3, 5, 24), (37, 300))  # [s, b, h] and [tokens, h]
TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    # one bf16 step: the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even)
    torch.bfloat16: dict(rtol=2**-7, atol=1e-5),
}


def reference(x, a, weight, bias, grad_s, grad_y, rms):
    """torch in fp64 on the same (rounded) inputs, s rounded to x's dtype as torch's add:
    s, y, and the gradients of x (= of a), weight, bias."""
    s = (x + a).double().requires_grad_()
    w = weight.double().requires_grad_()
    b = None if bias is None else bias.double().requires_grad_()
    h = s.shape[-1:]
    y = F.rms_norm(s, h, w, 1e-5) if rms else F.layer_norm(s, h, w, b, 1e-5)
    y.backward(grad_y.double())
    grads = [s.grad + grad_s.double(), w.grad] + ([] if rms else [b.grad])
    return [t.detach().float() for t in [s, y, *grads]]


def check_kernels(shapes, device="cpu"):
    from megadyn.core.tensor_parallel.add_norm import add_norm

    g = torch.Generator().manual_seed(0)
    for dtype in TOLERANCE:
        for shape in shapes:
            for rms in (False, True):
                h = shape[-1]
                x, a, grad_s, grad_y = (
                    (2 * torch.randn(shape, generator=g) + 1).to(device, dtype) for _ in range(4)
                )
                weight = (1 + torch.randn(h, generator=g)).to(device, dtype)
                bias = None if rms else torch.randn(h, generator=g).to(device, dtype)
                leaves = [t.clone().requires_grad_() for t in (x, a, weight)]
                if not rms:
                    leaves.append(bias.clone().requires_grad_())
                s, y = add_norm(*leaves[:3], None if rms else leaves[3], 1e-5, rms=rms)
                torch.autograd.backward([s, y], [grad_s, grad_y])
                got = [s, y, leaves[0].grad, leaves[2].grad] + ([] if rms else [leaves[3].grad])
                ref = reference(x, a, weight, bias, grad_s, grad_y, rms)
                what = f"{dtype} {shape} rms={rms}"
                assert all(t.dtype == dtype for t in got), what
                torch.testing.assert_close(leaves[1].grad, leaves[0].grad, msg=what)
                names = ["s", "y", "grad x", "grad weight", "grad bias"]
                for name, t, r in zip(names, got, ref):
                    # fp32 sums over rows: a tolerance on the tensor's scale
                    tol = dict(TOLERANCE[dtype], atol=TOLERANCE[dtype]["rtol"] * r.abs().max())
                    torch.testing.assert_close(t.float(), r, **tol, msg=f"{what} {name}")


def kernels_body(rank, world):
    from megadyn.core.tensor_parallel import add_norm_kernels

    default = add_norm_kernels.PROGRAMS_PER_SM
    for per_sm in (1, default):  # the interpreter counts 4 multiprocessors: 4 or 12 programs
        add_norm_kernels.PROGRAMS_PER_SM = per_sm
        try:
            check_kernels(SHAPES)
        finally:
            add_norm_kernels.PROGRAMS_PER_SM = default


def layer_body(rank, world, dtype, llama):
    """One transformer layer with its fused kernels (add + norm, and bias-GeLU for GPT-2) and
    without, on the same weights and input; bf16 under DDP (gradients through main_grad)."""
    from megadyn.core.distributed import DistributedDataParallel
    from megadyn.core.recompute import RecomputeConfig
    from megadyn.models import GPTConfig
    from megadyn.models.transformer import TransformerLayer

    group = dist.group.WORLD if world > 1 else None
    kw = dict(
        num_layers=1,
        hidden_size=48,
        num_attention_heads=4,
        vocab_size=64,
        max_position_embeddings=16,
        params_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    cfg = GPTConfig.llama(**kw, ffn_hidden_size=64) if llama else GPTConfig.gpt2(**kw)
    dp_group = [dist.new_group([r]) for r in range(world)][rank]  # dp 1 beside each tp rank
    layers = {}
    for fused in (True, False):
        switches = dict(residual_norm_fusion=fused, bias_gelu_fusion=fused)
        torch.manual_seed(1)  # the same weights in both
        layer = TransformerLayer(
            dataclasses.replace(cfg, **switches),
            group,
            False,
            None,
            RecomputeConfig(),
            dtype,
            "cpu",
        )
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.3)
        layers[fused] = (
            DistributedDataParallel(layer, dp_group) if dtype != torch.float32 else layer
        )
    x = torch.randn(8, 2, 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    w = torch.randn(8, 2, 48, generator=torch.Generator().manual_seed(3))
    grads = {fused: gradients(model, x, w) for fused, model in layers.items()}
    # bf16: the fused kernels round at other places than torch's; a few bf16 steps of each
    # tensor's largest element
    tol = TOLERANCE[torch.float32] if dtype == torch.float32 else dict(rtol=0, atol=2**-6)
    assert_close_scaled(grads[True], grads[False], tol)


def test_kernels_match_torch(monkeypatch):
    interpreted(monkeypatch, kernels_body)


@pytest.mark.parametrize(
    "tp, dtype, llama",
    [(1, torch.float32, False), (1, torch.bfloat16, False), (2, torch.bfloat16, True)],
)
def test_layer_fused_equals_plain(monkeypatch, tp, dtype, llama):
    interpreted(monkeypatch, layer_body, world=tp, args=(dtype, llama))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_kernels_match_torch_on_cuda():
    check_kernels(SHAPES + ((4096, 2048),), device="cuda")  # + the 1.42B model's hidden states


def hopper_body(rank, world):
    """Both kernels compile for sm_90 (no GPU needed), with 128-bit accesses at h = 2048."""
    from megadyn.core.tensor_parallel import add_norm_kernels as kernels
    from megadyn.testing.triton_compile import hopper_ptx

    sizes = {"rows": "i32", "cols": "i32"}
    bf16 = dict.fromkeys(["x_ptr", "a_ptr", "w_ptr", "b_ptr", "s_ptr", "y_ptr"], "*bf16")
    forward = {**bf16, "stats_ptr": "*fp32", **sizes, "eps": "fp32"}
    bf16 = dict.fromkeys(["grad_y_ptr", "grad_s_ptr", "s_ptr", "w_ptr", "grad_x_ptr"], "*bf16")
    backward = {**bf16, "stats_ptr": "*fp32", "partials_ptr": "*fp32", **sizes}
    backward["rows_per_program"] = "i32"
    block, num_warps, _ = kernels._launch_options(torch.empty(0), 2048)
    for kernel, signature in (
        (kernels._forward_kernel, forward),
        (kernels._backward_kernel, backward),
    ):
        for rms in (False, True):
            ptx = hopper_ptx(kernel, signature, dict(RMS=rms, BLOCK=block), num_warps)
            assert "ld.global.v4" in ptx and "st.global.v4" in ptx


def test_kernels_compile_for_hopper(monkeypatch):
    compiled(monkeypatch, hopper_body)


def cpu_refused_body(rank, world):
    from megadyn.core.tensor_parallel.add_norm import add_norm

    with pytest.raises(ValueError, match="CUDA tensors"):
        add_norm(torch.randn(4, 8), torch.randn(4, 8), torch.ones(8), torch.zeros(8), 1e-5)


def test_fused_refuses_cpu_outside_the_interpreter(monkeypatch):
    uninterpreted(monkeypatch, cpu_refused_body)
