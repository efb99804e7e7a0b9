"""--pointwise-fusion on a GPU (inductor's Triton kernels): each region in bf16 follows its
plain function in fp32, a bf16 Llama step follows the plain step, and a step captured as a
CUDA graph after eager warm-up steps compiles nothing more and replays the eager fused
step's losses. The norms' outputs computed again in the backward (their compiled forward
graphs replayed from their kept inputs) are the forward's bits under inductor, at
the test's width and the benchmark's. A bf16 and an FP8 fused step recomputing the inputs of
linear_qkv, linear_proj, linear_fc1 and fc2 (FP8 tensorwise: x^T cast again by Triton at the
forward's scale) equal the steps keeping them, bit for bit, and keep those inputs' bytes less
after the forward. Skipped without CUDA."""

import pytest
import torch
import torch._dynamo
from torch._inductor.compile_fx import compile_fx

from megadyn.core.pipeline import MicroBatchGraph
from megadyn.models import GPTModel, init_chunk, lm_loss
from megadyn.models.pointwise import Fusions
from tests.models.test_pointwise import LLAMA, cases, outputs_and_grads, with_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def rel_error(a, e) -> float:
    return ((a.float() - e.float()).norm() / e.float().norm().clamp(min=1e-12)).item()


def on_cuda(args, dtype):
    """The arguments as new CUDA leaves of `dtype` (RoPE's views of QKV become leaves)."""
    return [
        a.detach().cuda().to(dtype).requires_grad_(a.requires_grad) if torch.is_tensor(a) else a
        for a in args
    ]


def test_each_region_in_bf16_follows_fp32():
    torch._dynamo.reset()
    inductor = Fusions()  # no backend: inductor for CUDA tensors
    for name, fn, _, args in cases(torch.float32):
        ref_args, args = on_cuda(args, torch.float32), on_cuda(args, torch.bfloat16)
        ref_leaves = [a for a in ref_args if torch.is_tensor(a) and a.requires_grad]
        leaves = [a for a in args if torch.is_tensor(a) and a.requires_grad]
        want, want_grads, _ = outputs_and_grads(fn, ref_leaves, ref_args)
        got, got_grads, _ = outputs_and_grads(inductor(True, fn, args[0]), leaves, args)
        for a, e in zip(got + got_grads, want + want_grads):
            assert a.dtype == torch.bfloat16 and rel_error(a, e) < 1e-2, name


def test_the_swiglu_backward_kernel_follows_fp32():
    """swiglu_kernels.py's Triton kernel on a bf16 fc1 output of odd width (masked tails)
    against autograd of the plain function in fp32."""
    from megadyn.models.pointwise import swiglu
    from megadyn.models.swiglu_kernels import swiglu_backward

    g = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn(64, 3, 2 * 1500, device="cuda", generator=g)
    dh = torch.randn(64, 3, 1500, device="cuda", generator=g)
    x = y.clone().requires_grad_()
    (want,) = torch.autograd.grad(swiglu(x), x, dh)
    got = swiglu_backward(y.bfloat16(), dh.bfloat16())
    assert got.dtype == torch.bfloat16 and got.shape == y.shape
    assert rel_error(got, want) < 1e-2


def llama_step(cfg, tokens, labels):
    torch.manual_seed(5)
    model = GPTModel(cfg, device="cuda")
    init_chunk(model, 1)
    loss = model(tokens, labels=labels).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}


def test_a_bf16_llama_step_with_the_fusion_follows_the_plain_step():
    torch._dynamo.reset()
    cfg = LLAMA.with_(params_dtype=torch.bfloat16, hidden_size=256, ffn_hidden_size=512)
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, labels = torch.randint(0, 100, (2, 2, 16), generator=g, device="cuda")
    plain = llama_step(cfg, tokens, labels)
    fused = llama_step(cfg.with_(pointwise_fusion=True), tokens, labels)
    assert abs(fused[0] - plain[0]) < 1e-2 * plain[0]
    for name, grad in plain[1].items():
        assert rel_error(fused[1][name], grad) < 3e-2, name


def test_a_cuda_graph_of_a_fused_step_compiles_nothing_and_replays_the_eager_losses():
    torch._dynamo.reset()
    cfg = LLAMA.with_(params_dtype=torch.bfloat16, pointwise_fusion=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = []
    for _ in range(5):
        tokens, labels = torch.randint(0, 100, (2, 2, 16), generator=g, device="cuda")
        batches.append(dict(tokens=tokens, labels=labels, loss_mask=torch.ones_like(tokens)))
    runs = []
    for graph in (None, MicroBatchGraph(warmup_steps=2)):
        torch._dynamo.reset()
        compiles = []

        def counting_inductor(gm, example_inputs, compiles=compiles):
            compiles.append(gm)
            return compile_fx(gm, example_inputs)

        model = GPTModel(cfg, device="cuda")
        init_chunk(model, 1)
        with_backend(model, counting_inductor)
        losses = []
        for batch in batches:
            if graph is None or not graph.begin_step():
                loss = lm_loss(model(tokens=batch["tokens"], labels=batch["labels"]), batch)
                loss.backward()
                warm_up = len(compiles)
            else:
                with torch._dynamo.config.patch(error_on_recompile=True):
                    graph.prepare(model, batch, lm_loss, None)
                    loss = graph.replay(batch, 1.0)
            losses.append(loss.detach().float())
            model.zero_grad()
        runs.append(torch.stack(losses))
        # norm (the pre-MLP norm apart from the residual add, replayed in the backward),
        # rope_qk; swiglu without gradients (its backward is a Triton kernel)
        assert len(compiles) == warm_up == 3
    assert graph.captures == 1
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=1e-5)
    graph.reset()


@pytest.mark.parametrize("hidden", [64, 2048])
@pytest.mark.parametrize("bias", [False, True], ids=["rmsnorm", "layernorm"])
def test_the_norm_replayed_in_the_backward_gives_the_forward_bits(hidden, bias):
    """What linear_qkv's and linear_fc1's recomputation relies on: inductor's kernel of the
    norm region, replayed on the kept input, gives the forward's output bit for bit, and the
    replay compiles nothing."""
    from types import SimpleNamespace

    from megadyn.core.recomputed import replayed
    from megadyn.models.pointwise import norm

    torch._dynamo.reset()
    g = torch.Generator(device="cuda").manual_seed(1)

    def leaf(*shape, scale=1.0):
        t = torch.randn(*shape, generator=g, device="cuda") * scale
        return t.to(torch.bfloat16).requires_grad_()

    n = SimpleNamespace(weight=leaf(hidden), bias=leaf(hidden) if bias else None, eps=1e-5)
    fn_norm = Fusions()(True, norm, n.weight)  # inductor
    for scale in (1.0, 4.0):  # the second time with nothing left to compile
        x = leaf(256, 2, hidden, scale=scale)
        normed = fn_norm(x, n.weight, n.bias, n.eps)
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
            again = replayed(fn_norm)(x, n.weight, n.bias, n.eps)
        differ = (again != normed.detach()).sum().item()
        assert differ == 0, f"{differ} of {again.numel()} elements differ"
        normed.float().sum().backward()


def fp8_step(cfg, tokens, labels):
    """(bytes the forward leaves allocated, loss, gradients) of one fused FP8 step."""
    torch.manual_seed(5)
    model = GPTModel(cfg, device="cuda")
    init_chunk(model, 1)
    before = torch.cuda.memory_allocated()
    loss = model(tokens, labels=labels).float().mean()
    kept = torch.cuda.memory_allocated() - before
    loss.backward()
    return kept, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_steps_recomputing_the_linear_inputs_equal_keeping_them():
    import megadyn.models.transformer as transformer
    from megadyn.core.tensor_parallel.fp8 import Fp8Recipe
    from tests.models.test_pointwise_fp8 import recomputation_off

    recipes = [None, Fp8Recipe("e4m3"), Fp8Recipe("hybrid"), Fp8Recipe("e4m3", "rowwise")]
    if torch.cuda.get_device_capability() < (8, 9):  # FP8 GEMMs need 8.9 or newer
        recipes = [None]
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, labels = torch.randint(0, 100, (2, 2, 16), generator=g, device="cuda")
    views = []  # whether linear_proj's input is a view of the attention's output

    def heads_to_hidden(out, original=transformer.heads_to_hidden):
        h = original(out)
        views.append(h.data_ptr() == out.data_ptr())
        return h

    for recipe in recipes:
        torch._dynamo.reset()
        cfg = LLAMA.with_(
            params_dtype=torch.bfloat16, hidden_size=256, ffn_hidden_size=512,
            pointwise_fusion=True,
        )  # fmt: skip
        if recipe is not None:
            cfg = cfg.with_(fp8_format=recipe.format, fp8_recipe=recipe.recipe)
        fp8_step(cfg, tokens, labels)  # compiles, workspaces: allocations neither run counts
        views.clear()
        transformer.heads_to_hidden = heads_to_hidden
        try:
            kept, loss, grads = fp8_step(cfg, tokens, labels)
        finally:
            transformer.heads_to_hidden = heads_to_hidden.__defaults__[0]
        with recomputation_off():
            kept_off, loss_off, grads_off = fp8_step(cfg, tokens, labels)
        assert torch.equal(loss, loss_off), recipe
        for name, grad in grads.items():
            assert torch.equal(grad, grads_off[name]), (recipe, name)
        t, h, ffn = 2 * 16, cfg.hidden_size, cfg.ffn_size
        if recipe is not None and recipe.recipe == "tensorwise":  # fp8 x^T of four layers
            want = t * (3 * h + ffn)
        else:  # bf16 x; linear_proj's costs nothing where it is a view of the attention's output
            want = t * (2 * h + ffn) * 2 + (0 if all(views) else t * h * 2)
        assert kept_off - kept == cfg.num_layers * want, (recipe, views)
