"""The fused bias-GeLU (Triton) equals torch's gelu(y + b): output, input gradient, bias
gradient; and the GPT-2 MLP with it equals the plain MLP (bias in fc1's GEMM, F.gelu).

The kernels run on CPU tensors under Triton's interpreter, which must be switched on before
triton is imported: every check runs in spawned processes started with TRITON_INTERPRET=1.
Shapes whose rows and columns are not multiples of the tiles exercise the masks; small tiles
make a backward program walk several row blocks and leave the last row group partly empty.
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

SHAPES = ((3, 5, 37), (83, 300))  # [s, b, n] and [tokens, n]: no multiple of any tile
TILES = ((4, 32, 3), None)  # (BLOCK_M, BLOCK_N, ROW_BLOCKS); None: the module's defaults
TOLERANCE = {
    # fp32: 1 - tanh^2 near |tanh| = 1 cancels, in torch's fp32 GeLU as in ours
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    # one bf16 step: the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even)
    torch.bfloat16: dict(rtol=2**-7, atol=1e-5),
}


def reference(y, bias, grad_z, approximate):
    """torch in fp64 on the same (rounded) inputs: z, dz/dy, dz/db, as fp32."""
    y64 = y.double().requires_grad_()
    b64 = bias.double().requires_grad_()
    z = F.gelu(y64 + b64, approximate=approximate)
    z.backward(grad_z.double())
    return z.detach().float(), y64.grad.float(), b64.grad.float()


def check_kernels(shapes, device="cpu"):
    from megadyn.core.tensor_parallel import bias_gelu_kernels as kernels
    from megadyn.core.tensor_parallel.bias_gelu import bias_gelu

    defaults = (kernels.BLOCK_M, kernels.BLOCK_N, kernels.ROW_BLOCKS)
    g = torch.Generator().manual_seed(0)
    for dtype in TOLERANCE:
        for shape in shapes:
            for approximate in ("none", "tanh"):
                for tiles in TILES:
                    y = (3 * torch.randn(shape, generator=g)).to(device, dtype)
                    bias = torch.randn(shape[-1], generator=g).to(device, dtype)
                    grad_z = torch.randn(shape, generator=g).to(device, dtype)
                    y_, bias_ = y.clone().requires_grad_(), bias.clone().requires_grad_()
                    kernels.BLOCK_M, kernels.BLOCK_N, kernels.ROW_BLOCKS = tiles or defaults
                    try:
                        z = bias_gelu(y_, bias_, approximate)
                        z.backward(grad_z)
                    finally:
                        kernels.BLOCK_M, kernels.BLOCK_N, kernels.ROW_BLOCKS = defaults
                    ref_z, ref_dy, ref_db = reference(y, bias, grad_z, approximate)
                    what = f"{dtype} {shape} {approximate} tiles={tiles}"
                    assert z.dtype == y_.grad.dtype == bias_.grad.dtype == dtype, what
                    assert z.shape == y_.grad.shape == shape, what
                    tol = TOLERANCE[dtype]
                    torch.testing.assert_close(z.float(), ref_z, **tol, msg=what)
                    torch.testing.assert_close(y_.grad.float(), ref_dy, **tol, msg=what)
                    torch.testing.assert_close(bias_.grad.float(), ref_db, **tol, msg=what)


def kernels_body(rank, world):
    check_kernels(SHAPES)


def mlp_body(rank, world, dtype, approximate):
    """fc1 + GeLU + fc2 of one GPT-2 layer, fused and plain, on the same weights and input;
    bf16 under DDP, so gradients arrive in main_grad through the hooks (and the weight-gradient
    fusion), as in training."""
    from megadyn.core.distributed import DistributedDataParallel
    from megadyn.models import GPTConfig
    from megadyn.models.transformer import MLP

    group = dist.group.WORLD if world > 1 else None
    cfg = GPTConfig.gpt2(
        num_layers=1,
        hidden_size=24,
        num_attention_heads=2,
        ffn_hidden_size=76,  # 38 per rank at tp 2
        vocab_size=64,
        max_position_embeddings=16,
        params_dtype=dtype,
        openai_gelu=approximate == "tanh",
    )
    dp_group = [dist.new_group([r]) for r in range(world)][rank]  # dp 1 beside each tp rank
    mlps = {}
    for fused in (True, False):
        torch.manual_seed(1)  # the same weights in both (and on every rank: a test of the MLP)
        mlp = MLP(dataclasses.replace(cfg, bias_gelu_fusion=fused), group, False, dtype, "cpu")
        for p in mlp.parameters():
            torch.nn.init.normal_(p, std=0.5)
        mlps[fused] = DistributedDataParallel(mlp, dp_group) if dtype != torch.float32 else mlp
    x = torch.randn(7, 3, 24, generator=torch.Generator().manual_seed(2)).to(dtype)
    w = torch.randn(7, 3, 24, generator=torch.Generator().manual_seed(3))
    for fused, model in mlps.items():
        assert getattr(model, "module", model).fuses_bias_gelu(x) is fused
    grads = {fused: gradients(model, x, w) for fused, model in mlps.items()}
    assert "linear_fc1.bias" in grads[True]
    # bf16: the plain path rounds y + b once in the GEMM, the fused one rounds y, then adds b;
    # a few bf16 steps of each tensor's largest element
    tol = TOLERANCE[torch.float32] if dtype == torch.float32 else dict(rtol=0, atol=2**-6)
    assert_close_scaled(grads[True], grads[False], tol)


def test_kernels_match_torch(monkeypatch):
    interpreted(monkeypatch, kernels_body)


@pytest.mark.parametrize(
    "tp, dtype, approximate",
    [(1, torch.float32, "none"), (1, torch.bfloat16, "none"), (2, torch.bfloat16, "tanh")],
)
def test_mlp_fused_equals_plain(monkeypatch, tp, dtype, approximate):
    interpreted(monkeypatch, mlp_body, world=tp, args=(dtype, approximate))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_kernels_match_torch_on_cuda():
    check_kernels(SHAPES + ((4096, 8192),), device="cuda")  # + the 1.42B model's fc1 output


def hopper_body(rank, world):
    """Both kernels compile for sm_90 (no GPU needed), with 128-bit accesses."""
    from megadyn.core.tensor_parallel import bias_gelu_kernels as kernels
    from megadyn.testing.triton_compile import hopper_ptx

    sizes = {"rows": "i32", "cols": "i32"}
    signatures = {
        kernels._forward_kernel: dict.fromkeys(["y_ptr", "bias_ptr", "z_ptr"], "*bf16"),
        kernels._backward_kernel: {
            **dict.fromkeys(["grad_ptr", "y_ptr", "bias_ptr", "dy_ptr"], "*bf16"),
            "partials_ptr": "*fp32",
        },
    }
    for kernel, pointers in signatures.items():
        blocks = dict(BLOCK_M=kernels.BLOCK_M, BLOCK_N=kernels.BLOCK_N)
        if "ROW_BLOCKS" in kernel.arg_names:
            blocks["ROW_BLOCKS"] = kernels.ROW_BLOCKS
        for tanh in (False, True):
            constexprs = dict(TANH=tanh, **blocks)
            ptx = hopper_ptx(kernel, {**pointers, **sizes}, constexprs, kernels.NUM_WARPS)
            assert "ld.global.v4" in ptx and "st.global.v4" in ptx


def test_kernels_compile_for_hopper(monkeypatch):
    compiled(monkeypatch, hopper_body)


def cpu_refused_body(rank, world):
    from megadyn.core.tensor_parallel.bias_gelu import bias_gelu

    with pytest.raises(ValueError, match="CUDA tensors"):
        bias_gelu(torch.randn(4, 8), torch.randn(8))


def test_fused_refuses_cpu_outside_the_interpreter(monkeypatch):
    uninterpreted(monkeypatch, cpu_refused_body)


def test_plain_path_off_cuda_by_default():
    from megadyn.models.transformer import use_fused

    x = torch.randn(2, 3, dtype=torch.bfloat16)
    assert not use_fused(None, x)  # CPU
    assert use_fused(True, x) and not use_fused(False, x)
