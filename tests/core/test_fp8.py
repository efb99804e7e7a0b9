"""FP8 linear layers (--fp8-format, --fp8-recipe): the scaling math, accuracy, tp parity, flags.

- One layer's output and gradients equal, bit for bit, a quantize-dequantize computation
  written here from the definition (amax, power-of-two scale from frexp, clamp, round to
  float8, multiply back, fp32 matmul). The CPU's GEMM (fp8.emulated_mm) equals torch's CPU
  torch._scaled_mm bit for bit (too slow to train with, fine on a test's shapes).
- Tensorwise, the forward saves no fp8 W^T for the backward (x^T, the weight itself and the
  scales): the backward's W^T, from the step's weight cache or cast again at the forward's
  scale (the Triton cast too, under the interpreter), gives the same bits.
- A tiny GPT in fp8 tracks the same GPT without it: loss within 1e-2 relative, each weight
  gradient within 0.25 relative (L2; e4m3 keeps 3 mantissa bits, one rounding of up to
  2^-4 per operand), cosine similarity above 0.97.
- tp 2, with and without sequence parallelism, equals tp 1 in fp8 (loss and gradients within
  1e-5): amaxes over sharded dimensions are all-reduced, so every rank quantizes as tp 1.
- Training with each weight quantized once per step (fp8_cache.py) equals quantizing it at
  every micro batch bit for bit (losses and main_grad), over optimizer steps of the
  distributed optimizer, a live-reshard adopt and a checkpoint load; a copy kept past a step
  would differ (the test can tell).
"""

import contextlib
import importlib.util
import shlex

import pytest
import torch
import torch.distributed as dist

from megadyn.core.distributed import finalize_model_grads
from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.core.optimizer import OptimizerConfig
from megadyn.core.pipeline import forward_backward
from megadyn.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megadyn.core.tensor_parallel.fp8 import Fp8Recipe, emulated_mm
from megadyn.core.tensor_parallel.fp8_cache import weight_caches, weights_fixed
from megadyn.models import GPTModel, init_chunk, masked_mean
from megadyn.testing import spawn
from megadyn.training import checkpoint as ckpt
from megadyn.training.arguments import ConfigError, parse_args
from megadyn.training.build import build_model_parts, no_sync
from megadyn.training.config import MegadynConfig, TrainingConfig
from megadyn.training.tensors import adopt_tensors, export_tensors
from tests.core.test_tp_parity import VARIANTS, batch, gather_global
from tests.tiny import EIGHT_WAY, tiny_args

RECIPES = [Fp8Recipe("e4m3"), Fp8Recipe("hybrid"), Fp8Recipe("e4m3", "rowwise")]
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def dequantized(t, dtype, dim=None):
    """t as the GEMM sees it: scale 2^(e-1) where fp8_max / amax = m 2^e, m in [0.5, 1)."""
    t = t.float()
    amax = t.abs().amax() if dim is None else t.abs().amax(dim, keepdim=True)
    _, e = torch.frexp(FP8_MAX[dtype] / amax.clamp(min=1e-12))
    scale = torch.ldexp(torch.ones_like(amax), e - 1)
    return (t * scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype).float() / scale


def reference_grads(recipe, x, w, g):
    """y, dL/dx, dL/dW of y = x W^T for the output gradient g, in fp32 from dequantized
    operands (rowwise: scales along each GEMM's contraction dimension)."""
    fwd, bwd = recipe.forward_dtype, recipe.grad_dtype
    if recipe.recipe == "tensorwise":
        xq, wq, gq = dequantized(x, fwd), dequantized(w, fwd), dequantized(g, bwd)
        return xq @ wq.t(), gq @ wq, gq.t() @ xq
    y = dequantized(x, fwd, 1) @ dequantized(w, fwd, 1).t()
    grad_x = dequantized(g, bwd, 1) @ dequantized(w, bwd, 0)
    grad_w = dequantized(g, bwd, 0).t() @ dequantized(x, fwd, 0)
    return y, grad_x, grad_w


@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_cpu_gemm_equals_torch_scaled_mm(rowwise, out_dtype):
    gen = torch.Generator().manual_seed(5)
    a = (torch.randn(48, 64, generator=gen) * 40).to(torch.float8_e4m3fn)
    b = torch.randn(32, 64, generator=gen).to(torch.float8_e5m2).t()  # [k, n] column-major
    a_inv = torch.exp2(torch.randint(-9, 3, (48, 1) if rowwise else (), generator=gen).float())
    b_inv = torch.exp2(torch.randint(-9, 3, (1, 32) if rowwise else (), generator=gen).float())
    bias = None if rowwise else torch.randn(32, generator=gen).to(out_dtype)
    got = emulated_mm(a, a_inv, b, b_inv, out_dtype, bias)
    try:
        want = torch._scaled_mm(a, b, a_inv, b_inv, bias=bias, out_dtype=out_dtype)
    except RuntimeError as err:
        if not rowwise:
            raise
        why = str(err).splitlines()[0]
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes no rowwise scales: {why}")
    assert torch.equal(got, want)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.format}-{r.recipe}")
@pytest.mark.parametrize("kind", [ColumnParallelLinear, RowParallelLinear])
def test_layer_equals_reference_quantize_dequantize(recipe, kind):
    gen = torch.Generator().manual_seed(3)
    layer = kind(64, 48, None, bias=True, fp8=recipe)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64, generator=gen) * 0.05)
        layer.bias.copy_(torch.randn(48, generator=gen))
    x = (torch.randn(16, 2, 64, generator=gen) * 3).requires_grad_()  # [s, b, in]
    g = torch.randn(16, 2, 48, generator=gen) * 1e-3
    y = layer(x)
    y.backward(g)
    ref_y, ref_gx, ref_gw = reference_grads(
        recipe, x.detach().reshape(32, 64), layer.weight.detach(), g.reshape(32, 48)
    )
    assert torch.equal(y.detach(), (ref_y + layer.bias.detach()).view(16, 2, 48))
    assert torch.equal(x.grad, ref_gx.view(16, 2, 64))
    assert torch.equal(layer.weight.grad, ref_gw)
    assert torch.equal(layer.bias.grad, g.sum((0, 1)))


def saved_for_backward(layer, x) -> tuple:
    """(y, [(dtype, shape, bytes) of each tensor the forward saves for the backward that is
    not the layer's weight itself])."""
    saved = []

    def pack(t):
        if t.data_ptr() != layer.weight.data_ptr():  # the parameter: a reference, no copy
            saved.append((t.dtype, tuple(t.shape), t.numel() * t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return layer(x), saved


@pytest.mark.parametrize("recipe", RECIPES[:2], ids=lambda r: r.format)
@pytest.mark.parametrize("kind", [ColumnParallelLinear, RowParallelLinear])
def test_tensorwise_backward_casts_the_weight_again_instead_of_keeping_w_t(recipe, kind):
    """The forward keeps x^T in fp8, the weight (no copy) and the two scales, no fp8 W^T:
    the backward takes W^T from the step's weight cache, or without it casts W^T again at
    the forward's scale, bit for bit the reference either way."""
    gen = torch.Generator().manual_seed(6)
    layer = kind(64, 48, None, bias=False, fp8=recipe)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64, generator=gen) * 0.05)
    x = (torch.randn(32, 64, generator=gen) * 3).requires_grad_()
    g = torch.randn(32, 48, generator=gen) * 1e-3
    _, ref_gx, ref_gw = reference_grads(recipe, x.detach(), layer.weight.detach(), g)
    for scope in (contextlib.nullcontext, lambda: weights_fixed([layer])):  # cache off, on
        x.grad = layer.weight.grad = None
        with scope():
            y, saved = saved_for_backward(layer, x)
            y.backward(g)
        assert saved == [(recipe.forward_dtype, (64, 32), 64 * 32)] + [(torch.float32, (), 4)] * 2
        assert torch.equal(x.grad, ref_gx) and torch.equal(layer.weight.grad, ref_gw)
    assert (layer.fp8.weight_cache.fills, layer.fp8.weight_cache.hits) == (1, 1)  # W^T: cached


def given_scale_cast_body(rank, world):
    from megadyn.core.tensor_parallel.fp8 import AMAX_FLOOR
    from megadyn.core.tensor_parallel.fp8_kernels import quantize_tensorwise

    gen = torch.Generator().manual_seed(8)
    for dtype, mul in ((torch.float8_e4m3fn, 0.05), (torch.float8_e5m2, 300.0)):
        w = (torch.randn(96, 80, generator=gen) * mul).to(torch.bfloat16)  # tiles cut at 64
        q, inv, qt = quantize_tensorwise(w, dtype, FP8_MAX[dtype], AMAX_FLOOR, None, True)
        again = quantize_tensorwise(w, dtype, FP8_MAX[dtype], AMAX_FLOOR, None, True, inv)
        assert again[1] is inv
        for a, b in zip((q, qt), (again[0], again[2])):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        only = quantize_tensorwise(w, dtype, FP8_MAX[dtype], AMAX_FLOOR, None, True, inv, False)
        assert only[0] is None and torch.equal(only[2].view(torch.uint8), qt.view(torch.uint8))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_cast_at_a_given_scale_equals_the_amax_cast(monkeypatch):
    """fp8.requantize's CUDA path, run by Triton's interpreter on CPU tensors (switched on
    before triton is imported: a spawned process)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spawn(given_scale_cast_body, world=1)


def test_bf16_weight_gradient_goes_into_main_grad():
    """The gradient-accumulation path: a bf16 weight's fp8 gradient (written in bf16 by the
    GEMM) is added into the fp32 main_grad."""
    recipe = Fp8Recipe("hybrid")
    gen = torch.Generator().manual_seed(4)
    layer = ColumnParallelLinear(32, 32, None, bias=False, fp8=recipe, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(32, 32, generator=gen))
    layer.weight.main_grad = torch.ones(32, 32)
    x = torch.randn(16, 32, generator=gen).to(torch.bfloat16)
    g = torch.randn(16, 32, generator=gen).to(torch.bfloat16)
    layer(x).backward(g)
    _, _, ref_gw = reference_grads(recipe, x, layer.weight.detach(), g)
    assert layer.weight.grad_added_to_main_grad
    assert torch.equal(layer.weight.main_grad, 1 + ref_gw.to(torch.bfloat16).float())


def loss_and_grads(cfg, layout, rank_list):
    groups = ParallelGroups.build(layout, rank_list)
    model = GPTModel(cfg, tp_group=groups.tp_group, sequence_parallel=layout.sequence_parallel)
    init_chunk(model, 1234)
    tokens, labels, mask = batch()
    loss = masked_mean(model(tokens, labels=labels), mask)
    loss.backward()
    for p in model.parameters():  # replicated params under sequence parallelism
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, group=groups.tp_group)
    grads = gather_global(model, {n: p.grad for n, p in model.named_parameters()}, groups.tp_group)
    groups.destroy()
    # no fp8 state: the state dict (what checkpoints and reshards carry) is the parameters'
    assert list(model.state_dict()) == [n for n, _ in model.named_parameters()]
    return loss.detach(), grads


CASES = {  # model variant: recipes (gpt2 adds biases and GeLU to llama's SwiGLU and GQA)
    "llama": RECIPES,
    "gpt2": [Fp8Recipe("hybrid")],
}


def parity_body(rank, world):
    for name, recipes in CASES.items():
        base = VARIANTS[name]
        plain_loss, plain_grads = loss_and_grads(base, Layout(tp=1, dp=2), range(2))
        for recipe in recipes:
            cfg = base.with_(fp8_format=recipe.format, fp8_recipe=recipe.recipe)
            what = f"{name} {recipe.format} {recipe.recipe}"
            loss, grads = loss_and_grads(cfg, Layout(tp=1, dp=2), range(2))
            assert abs(loss / plain_loss - 1) < 1e-2, (what, loss, plain_loss)
            for n, g in grads.items():
                ref = plain_grads[n]
                rel = (g - ref).norm() / ref.norm()
                cos = torch.nn.functional.cosine_similarity(g.flatten(), ref.flatten(), dim=0)
                assert rel < 0.25 and cos > 0.97, (what, n, rel.item(), cos.item())
            for sp in (False, True) if recipe.recipe == "rowwise" else (True,):
                tp_loss, tp_grads = loss_and_grads(
                    cfg, Layout(tp=2, sequence_parallel=sp), range(2)
                )
                msg = f"{what} tp2 sp={sp}"
                torch.testing.assert_close(tp_loss, loss, rtol=1e-5, atol=1e-6, msg=msg)
                for n, g in tp_grads.items():
                    torch.testing.assert_close(g, grads[n], rtol=1e-5, atol=1e-6, msg=f"{msg} {n}")


MICRO, STEPS, MBS, SEQ = 4, 3, 2, 16


def fp8_job(recipe: Fp8Recipe, dp: int, seed: int) -> MegadynConfig:
    model = VARIANTS["llama"].with_(fp8_format=recipe.format, fp8_recipe=recipe.recipe)
    return MegadynConfig(
        model=model,
        training=TrainingConfig(
            micro_batch_size=MBS, global_batch_size=dp * MBS * MICRO, seed=seed
        ),
        optimizer=OptimizerConfig(lr=1e-2, use_distributed_optimizer=True),
    )


def micro_batches(step: int, dp_rank: int):
    gen = torch.Generator().manual_seed(100 * step + dp_rank)
    for _ in range(MICRO):
        tokens = torch.randint(0, 100, (MBS, SEQ + 1), generator=gen)
        yield dict(
            tokens=tokens[:, :-1],
            labels=tokens[:, 1:],
            loss_mask=torch.ones(MBS, SEQ),
            position_ids=torch.arange(SEQ).expand(MBS, -1),
        )


def train(parts, groups, steps: range) -> list:
    """Per step: (micro-batch losses, every main_grad before the update)."""
    out = []
    for step in steps:
        parts.optimizer.zero_grad()
        losses = forward_backward(
            parts.ddp,
            groups,
            micro_batches(step, groups.dp_rank),
            MICRO,
            config=parts.pipeline_cfg,
            loss_fn=lambda per_token, b: masked_mean(per_token, b["loss_mask"]),
            no_sync=lambda: no_sync(parts.ddp),
        )
        finalize_model_grads(parts.ddp, groups)
        grads = [p.main_grad.clone() for c in parts.chunks for p in c.parameters()]
        parts.optimizer.step()
        out.append((torch.stack(losses), grads))
    return out


def quantizing_every_micro_batch(parts, groups, steps: range) -> list:
    """`train` with each weight quantized at every use (the cache disabled)."""
    for cache in weight_caches(parts.ddp):
        cache.enabled = False
    return train(parts, groups, steps)


def assert_equal_steps(got: list, want: list, what: str) -> None:
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(got, want)):
        assert torch.equal(loss, ref_loss), (what, step, loss, ref_loss)
        assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads)), (what, step)


CACHE_CASES = [  # dp 2: the distributed optimizer's all-gather; tp 2: cached amax all-reduces
    (Fp8Recipe("hybrid"), Layout(dp=2)),
    (Fp8Recipe("e4m3", "rowwise"), Layout(tp=2, sequence_parallel=True)),
]


def cache_body(rank, world, root):
    cpu = torch.device("cpu")
    for recipe, layout in CACHE_CASES:
        groups = ParallelGroups.build(layout, range(2))
        what = f"{recipe.format} {recipe.recipe} tp{layout.tp} dp{layout.dp}"
        cfg = fp8_job(recipe, layout.dp, seed=7)
        cached = build_model_parts(cfg, cfg.model, groups, cpu)
        plain = build_model_parts(cfg, cfg.model, groups, cpu)
        path = f"{root}/{recipe.recipe}_tp{layout.tp}"
        ckpt.save_checkpoint(path, 0, plain.chunks, plain.optimizer, groups, {})
        reference = quantizing_every_micro_batch(plain, groups, range(STEPS))
        assert_equal_steps(train(cached, groups, range(STEPS)), reference, what)
        caches = weight_caches(cached.ddp)
        # tensorwise: W and W^T cast in one pass, which every backward takes; rowwise: W and
        # W^T scaled apart, the first forward and backward quantize
        per_step = 1 if recipe.recipe == "tensorwise" else 2
        hits = 2 * MICRO - 1 if recipe.recipe == "tensorwise" else 2 * (MICRO - 1)
        assert len(caches) == 4 * cfg.model.num_layers  # qkv, proj, fc1, fc2
        assert all(c.fills == STEPS * per_step for c in caches), what
        assert all(c.hits == STEPS * hits for c in caches), what
        assert all(c.fills == 0 for c in weight_caches(plain.ddp))
        # a live reshard's adopt and a checkpoint load change the weights between steps
        other = build_model_parts(fp8_job(recipe, layout.dp, seed=8), cfg.model, groups, cpu)
        for parts in (cached, plain):
            adopt_tensors(
                parts.chunks,
                parts.optimizer,
                export_tensors(other.chunks, other.optimizer, cfg.optimizer),
            )
        after_adopt = train(cached, groups, range(STEPS, STEPS + 1))
        assert_equal_steps(
            after_adopt,
            quantizing_every_micro_batch(plain, groups, range(STEPS, STEPS + 1)),
            f"{what} adopt",
        )
        for parts in (cached, plain):
            ckpt.load_checkpoint(path, parts.chunks, parts.optimizer, groups, load_rng=False)
        first = train(cached, groups, range(1))  # step 0's weights again: its losses, grads
        assert_equal_steps(first, reference[:1], f"{what} load")
        assert_equal_steps(quantizing_every_micro_batch(plain, groups, range(1)), first, what)
        if layout.dp > 1:  # a copy kept past the step (an outer scope) is stale, and shows:
            with weights_fixed(cached.ddp):  # the parameter all-gather leaves `_version` alone
                stale = train(cached, groups, range(1, 3))
            fresh = quantizing_every_micro_batch(plain, groups, range(1, 3))
            assert torch.equal(stale[0][0], fresh[0][0])
            assert not torch.equal(stale[1][0], fresh[1][0])
        groups.destroy()


def fp8_jobs_body(rank, world, root):
    parity_body(rank, world)
    cache_body(rank, world, root)


def test_fp8_tracks_plain_model_tp2_equals_tp1_and_cached_weights_are_exact(tmp_path):
    """One spawned job for `parity_body` and `cache_body` (processes start slowly)."""
    spawn(fp8_jobs_body, world=2, args=(str(tmp_path),))


BASE = shlex.join(tiny_args(EIGHT_WAY, train_iters=10))


@pytest.mark.parametrize(
    "extra,flag",
    [
        ("--fp8-recipe rowwise", "--fp8-recipe applies to --fp8-format"),
        ("--fp8-format hybrid --fp8-recipe rowwise", "--fp8-format hybrid"),
        ("--fp8-format e4m3 --sequence-parallel --tensor-model-parallel-size 2 --tp-comm-overlap",
         "--tp-comm-overlap"),
        ("--fp8-format e4m3 --seq-length 36 --micro-batch-size 1", "--micro-batch-size"),
        ("--fp8-format e4m3 --ffn-hidden-size 136", "--ffn-hidden-size (136)"),
        ("--fp8-format e4m3 --hidden-size 96 --tensor-model-parallel-size 4", "--hidden-size (96)"),
    ],
)  # fmt: skip
def test_flags_are_refused_by_name(extra, flag):
    with pytest.raises(ConfigError, match=None) as err:
        parse_args(shlex.split(f"{BASE} {extra}"), world_size=8)
    assert flag in str(err.value)
    parse_args(shlex.split(f"{BASE} --fp8-format hybrid"), world_size=8)  # the plain case runs


def test_no_fp8_weight_cache_quantizes_at_every_use():
    """--no-fp8-weight-cache reaches every fp8 layer: inside a step's scope nothing is kept."""
    cfg = VARIANTS["llama"].with_(fp8_format="hybrid", fp8_weight_cache=False)
    model = GPTModel(cfg)
    init_chunk(model, 1)
    caches = weight_caches([model])
    assert caches and not any(cache.enabled for cache in caches)
    tokens, labels, mask = batch()
    with weights_fixed([model]):
        for _ in range(2):  # two micro batches
            masked_mean(model(tokens, labels=labels), mask).backward()
    assert [(cache.fills, cache.hits) for cache in caches] == [(0, 0)] * len(caches)
