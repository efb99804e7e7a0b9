"""The compiled pointwise regions of the transformer block (megadyn/models/pointwise.py,
--pointwise-fusion) on the CPU: each region compiled against its plain function, forward and
backward, what it keeps for the backward, its dropout, and a Llama step with the fusion on
against the plain step (also with recomputation, FP8, GPT-2's LayerNorm block, and without
compiling after the warm-up under the CUDA graph's capture seam). Compiled here means
torch.compile with inductor's decompositions and partitioner, run eagerly
('aot_eager_decomp_partition'); inductor's Triton code is checked on a GPU
(test_pointwise_gpu.py). Tensor and sequence parallelism: test_pointwise_parallel.py."""

import contextlib
import dataclasses

import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

from megadyn.core.pipeline import MicroBatchGraph
from megadyn.core.recompute import RecomputeConfig
from megadyn.models import GPTConfig, GPTModel, init_chunk, lm_loss
from megadyn.models.pointwise import (
    Fusions,
    add_norm,
    dropout_add,
    norm,
    rope_qk,
    swiglu,
)
from megadyn.models.transformer import rope_tables
from tests.core.test_cuda_graph import RecordOnly  # the CUDA graph's CPU stand-in

COMPILED = "aot_eager_decomp_partition"
LLAMA = GPTConfig.llama(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=96,
    vocab_size=100,
    make_vocab_size_divisible_by=8,
    max_position_embeddings=16,
)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles anew, and hitting the recompile limit (a silent eager fallback)
    fails it."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


def compiled(fn, backend=COMPILED):
    return Fusions(backend=backend)(True, fn, torch.empty(0))


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_()


def qk_views(dtype, s=7, b=2, groups=2, q_per_group=2, d=16):
    """Queries [b, g, q, s, d] and keys [b, g, s, d] as the model makes them: permuted views of
    one QKV tensor [s, b, g, q + 2, d]."""
    qkv = rand(s, b, groups, q_per_group + 2, d, dtype=dtype, seed=3)
    q, k, _ = torch.split(qkv, [q_per_group, 1, 1], dim=3)
    return qkv, q.permute(1, 2, 3, 0, 4), k.squeeze(3).permute(1, 2, 0, 3)


def cases(dtype):
    """(name, fn, leaf tensors, arguments) of each region on odd shapes."""
    s, b, h, f = 7, 2, 48, 40
    x, r, w, bias = rand(s, b, h, dtype=dtype), rand(s, b, h, dtype=dtype, seed=1), rand(h), rand(h)
    w, bias = (t.detach().to(dtype).requires_grad_() for t in (w, bias))
    y = rand(s, b, 2 * f, dtype=dtype, seed=2)
    qkv, q, k = qk_views(dtype)
    cos, sin = rope_tables(7, 16, 10000.0, "cpu", dtype)
    cos_b, sin_b = rope_tables(
        7, 16, 10000.0, "cpu", dtype, torch.tensor([[3, 2, 1, 0, 1, 2, 3]] * 2)
    )
    return [
        ("rmsnorm", norm, [x, w], (x, w, None, 1e-5)),
        ("layernorm", norm, [x, w, bias], (x, w, bias, 1e-5)),
        ("add_norm", add_norm, [r, x, w], (r, x, w, None, 1e-5, 0.0)),
        ("swiglu", swiglu, [y], (y,)),
        ("rope", rope_qk, [qkv], (q, k, cos, sin)),
        ("rope per sample", rope_qk, [qkv], (q, k, cos_b, sin_b)),
    ]


def outputs_and_grads(fn, leaves, args):
    out = fn(*args)
    out = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(9)
    grads = [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in out]
    got = torch.autograd.grad(out, leaves, grads)
    return [o.detach() for o in out], list(got), [o.stride() for o in out]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_compiled_region_matches_its_plain_function(dtype):
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, fn, leaves, args in cases(dtype):
        want, want_grads, want_strides = outputs_and_grads(fn, leaves, args)
        got, got_grads, got_strides = outputs_and_grads(compiled(fn), leaves, args)
        assert got_strides == want_strides, name  # e.g. RoPE's [b, n, s, d] views of QKV
        if name.startswith("rope"):  # the queries' heads merge without a copy
            b, g, q, s, d = got[0].shape
            assert got[0].view(b, g * q, s, d).data_ptr() == got[0].data_ptr()
        for a, e in zip(got + got_grads, want + want_grads):
            torch.testing.assert_close(a, e, **tol, msg=name)


def test_the_plain_functions_compute_what_they_say():
    x, w, y = rand(5, 3, 8, dtype=torch.float64), rand(8, dtype=torch.float64), rand(5, 3, 12)

    def rms(t):
        return t * w / (t.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()

    torch.testing.assert_close(norm(x, w, None, 1e-6), rms(x))
    total, normed = add_norm(x, 2 * x, w, None, 1e-6, 0.0)
    torch.testing.assert_close(total, 3 * x)
    torch.testing.assert_close(normed, rms(3 * x))
    gate, up = y[..., :6], y[..., 6:]
    torch.testing.assert_close(swiglu(y), gate * torch.sigmoid(gate) * up)
    # RoPE rotates each pair (i, i + d/2) by position x frequency: a complex product
    _, q, k = qk_views(torch.float64)
    cos, sin = rope_tables(7, 16, 10000.0, "cpu", torch.float64)
    angle = torch.complex(cos[:, :8], sin[:, :8])
    for got, t in zip(rope_qk(q, k, cos, sin), (q, k)):
        turned = torch.complex(t[..., :8], t[..., 8:]) * angle
        torch.testing.assert_close(got, torch.cat([turned.real, turned.imag], -1))
    # queries by key group [b, g, q, s, d] take per-sample tables [b, 1, s, d] as [b, n, s, d] do
    positions = torch.tensor([[3, 2, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]])
    cos, sin = rope_tables(7, 16, 10000.0, "cpu", torch.float64, positions)
    by_group, keys = rope_qk(q, k, cos, sin)
    heads = q.reshape(2, 4, 7, 16)
    torch.testing.assert_close(by_group.flatten(1, 2), rope_qk(heads, k, cos, sin)[0])
    torch.testing.assert_close(keys[1], rope_qk(q[1:], k[1:], cos[1:], sin[1:])[1][0])


def saved_bytes(fn, *args) -> int:
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(total)


def test_compiled_regions_keep_less_for_the_backward():
    y = rand(16, 2, 192, dtype=torch.bfloat16)
    bytes_y = y.numel() * 2
    assert saved_bytes(swiglu, y) == bytes_y * 3 // 2  # gate, up and silu(gate)
    assert saved_bytes(compiled(swiglu), y) == bytes_y  # fc1's output alone: silu recomputed
    x, w = rand(16, 2, 64, dtype=torch.bfloat16), rand(64, dtype=torch.bfloat16)
    per_token = 16 * 2 * 4  # one fp32 statistic per token
    kept = x.numel() * 2 + w.numel() * 2 + per_token  # the bf16 input, no fp32 copy
    assert saved_bytes(compiled(norm), x, w, None, 1e-5) == kept
    assert saved_bytes(compiled(add_norm), x, x, w, None, 1e-5, 0.0) == kept


def test_the_linear_layers_compute_their_inputs_again_instead_of_keeping_them(monkeypatch):
    """Under the fusion the linear layers keep no copy of their inputs: linear_qkv's and
    linear_fc1's (the norms' outputs) are computed again from the norms' inputs (which their
    backwards keep), linear_proj's from the attention's output (which its backward keeps),
    fc2's (SwiGLU's output, 1/2 of fc1's) from fc1's output (which SwiGLU's backward keeps);
    the gradients are bit for bit those of keeping them. Inside full recomputation the
    checkpoint decides and nothing is replaced; linear_proj keeps its input under selective
    recomputation, which drops the attention's output, and with the math kernel, which does
    not keep it. With hidden dropout the norm takes the sum as its input as without it.
    --keep-fc2-input keeps fc2's input alone, --keep-norm-outputs linear_qkv's and linear_fc1's
    (where the pre-MLP norm joins the residual add: the same step to the bit)."""
    import megadyn.core.recomputed as scope
    import megadyn.models.transformer as transformer

    replaced = []
    original = scope._Recomputed.__init__

    def counting(self, t, *args):
        replaced.append(tuple(t.shape))
        original(self, t, *args)

    monkeypatch.setattr(scope._Recomputed, "__init__", counting)
    cfg = LLAMA.with_(params_dtype=torch.bfloat16, pointwise_fusion=True)
    recomputed = model_step(cfg, COMPILED)
    t, h, ffn = 2 * 16, cfg.hidden_size, cfg.ffn_size  # micro batch 2, seq 16: [tokens, in]
    qkv, proj, fc1, fc2 = (t, h), (t, h), (t, h), (t, ffn)
    assert replaced == [qkv, proj, fc1, fc2] * cfg.num_layers
    replaced.clear()
    selective = model_step(cfg, COMPILED, RecomputeConfig("selective"))
    assert replaced == [qkv, fc1, fc2] * cfg.num_layers
    replaced.clear()
    model_step(cfg.with_(attention_backend="unfused"), COMPILED)  # math: keeps no output
    assert replaced == [qkv, fc1, fc2] * cfg.num_layers
    replaced.clear()
    dropout = [
        cfg.with_(hidden_dropout=0.1),
        cfg.with_(bias_dropout_fusion=False, hidden_dropout=0.1),
    ]
    with_dropout = [model_step(c, COMPILED) for c in dropout]
    assert replaced == [qkv, proj, fc1, fc2] * cfg.num_layers * 2
    replaced.clear()
    keep_fc2 = model_step(cfg.with_(keep_fc2_input=True), COMPILED)
    assert replaced == [qkv, proj, fc1] * cfg.num_layers
    assert_same_step(recomputed, keep_fc2, 0.0, "fc2 kept")
    replaced.clear()
    keep_normed = model_step(cfg.with_(keep_norm_outputs=True), COMPILED)
    assert replaced == [proj, fc2] * cfg.num_layers
    assert_same_step(recomputed, keep_normed, 0.0, "norm outputs kept")
    monkeypatch.setattr(transformer, "recomputed_in_backward", lambda *a: contextlib.nullcontext())
    assert_same_step(recomputed, model_step(cfg, COMPILED), 0.0, "kept")
    assert_same_step(selective, model_step(cfg, COMPILED, RecomputeConfig("selective")), 0.0)
    for c, step in zip(dropout, with_dropout):
        assert_same_step(step, model_step(c, COMPILED), 0.0, "dropout")
    monkeypatch.undo()
    replaced.clear()
    monkeypatch.setattr(scope._Recomputed, "__init__", counting)
    model_step(cfg, COMPILED, RecomputeConfig("full", "uniform", 1))
    assert replaced == []


def test_the_attention_kernels_named_keep_their_output():
    """linear_proj's input is computed again from the attention's output only where the
    kernel's backward node keeps it (a saved `output`): flash, efficient, cuDNN, flash on the
    CPU."""
    from megadyn.models.transformer import _KEEPS_OUTPUT

    for name in _KEEPS_OUTPUT:
        assert "_saved_output" in dir(getattr(torch._C._functions, name + "0")), name


def test_swiglu_backward_is_the_gradient_of_swiglu():
    """The one-pass backward (swiglu_kernels.py; its torch form on the CPU) against autograd
    of the plain function: fp32 to rounding, bf16 rounded once from fp32."""
    from megadyn.models.pointwise import fused_swiglu
    from megadyn.models.swiglu_kernels import swiglu_backward

    y = rand(16, 2, 192, dtype=torch.float64).requires_grad_()
    dh = rand(16, 2, 96, dtype=torch.float64, seed=3)
    (want,) = torch.autograd.grad(swiglu(y), y, dh)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        got = swiglu_backward(y.detach().to(dtype), dh.to(dtype))
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    x = y.detach().float().requires_grad_()
    (got,) = torch.autograd.grad(fused_swiglu(x, compiled(swiglu)), x, dh.float())
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_a_recomputed_tensor_is_freed_after_the_forward():
    """Neither the layer that saved it nor the hooks keep the recomputed tensor alive (the
    hooks live as long as the graph), and the backward gets it back bit for bit."""
    import weakref

    from megadyn.core.recomputed import recomputed_in_backward

    y = rand(16, 2, 192, dtype=torch.bfloat16).requires_grad_()
    w = rand(32, 96, dtype=torch.bfloat16, seed=1).requires_grad_()
    want = torch.autograd.grad((swiglu(y) @ w.t()).float().square().sum(), (y, w))
    h = swiglu(y)
    freed = weakref.ref(h)
    with recomputed_in_backward(h, swiglu, y):
        out = h @ w.t()
    del h
    assert freed() is None
    got = torch.autograd.grad(out.float().square().sum(), (y, w))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_the_compiled_dropout_add_drops_and_scales_as_its_backward_says():
    r, y = rand(64, 4, 32), rand(64, 4, 32, seed=1)
    fn = compiled(dropout_add)
    torch.manual_seed(3)
    out = fn(r, y, 0.25)
    (dy,) = torch.autograd.grad(out.sum(), y)
    kept = dy != 0
    torch.testing.assert_close(out - r, torch.where(kept, y / 0.75, 0.0).detach())
    torch.testing.assert_close(dy, kept / 0.75)
    assert 0.2 < 1 - kept.float().mean().item() < 0.3
    torch.manual_seed(3)  # the generator decides the mask
    assert torch.equal(fn(r, y, 0.25), out)
    x, normed = compiled(add_norm)(r, y, torch.ones(32), None, 1e-5, 0.25)
    assert not torch.equal(x, r + y) and torch.equal(normed, norm(x, torch.ones(32), None, 1e-5))


def model_step(cfg, backend=None, recompute=None, seed=0):
    """Loss and gradients of one micro batch; `backend` compiles the fused regions on the
    CPU (None: the model's own choice, eager here)."""
    torch.manual_seed(5)
    model = GPTModel(cfg, recompute_cfg=recompute)
    init_chunk(model, 1)
    if backend is not None:
        with_backend(model, backend)
    g = torch.Generator().manual_seed(seed)
    tokens, labels = torch.randint(0, 100, (2, 2, 16), generator=g)
    loss = model(tokens, labels=labels).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}


def with_backend(model, backend):
    for module in model.modules():
        if isinstance(getattr(module, "fusions", None), Fusions):
            module.fusions = dataclasses.replace(module.fusions, backend=backend)


def assert_same_step(got, want, rtol, what=""):
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=rtol, msg=what)
    for name, grad in want[1].items():
        err = ((got[1][name] - grad).norm() / grad.norm().clamp(min=1e-12)).item()
        assert err <= rtol, f"{what} {name}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_llama_step_with_the_fusion_matches_the_plain_step(dtype):
    plain = LLAMA.with_(params_dtype=dtype)
    fused = plain.with_(pointwise_fusion=True)
    assert Fusions.from_config(fused).label == "norm+swiglu+rope+residual"
    assert Fusions.from_config(plain).label is None
    want = model_step(plain)
    eager = model_step(fused)  # on the CPU the fused regions run as written: the same ops
    assert_same_step(eager, want, 0.0, "eager")
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_same_step(model_step(fused, COMPILED), want, rtol, "compiled")
    for rc in (RecomputeConfig("full", "uniform", 1), RecomputeConfig("selective")):
        assert_same_step(model_step(fused, COMPILED, rc), want, rtol, rc.granularity)
    one_off = fused.with_(bias_swiglu_fusion=False)
    assert Fusions.from_config(one_off).label == "norm+rope+residual"
    assert_same_step(model_step(one_off, COMPILED), want, rtol, "no swiglu fusion")


def test_gpt2_and_fp8_steps_with_the_fusion_match_their_plain_steps():
    gpt2 = GPTConfig.gpt2(
        num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100,
        make_vocab_size_divisible_by=8, max_position_embeddings=16, hidden_dropout=0.0,
    )  # fmt: skip
    assert Fusions.from_config(gpt2.with_(pointwise_fusion=True)).label == "norm+residual"
    for plain in (gpt2, LLAMA.with_(fp8_format="hybrid")):  # FP8: the norm feeds its GEMM
        fused = model_step(plain.with_(pointwise_fusion=True), COMPILED)
        assert_same_step(fused, model_step(plain), 1e-5, plain.normalization)


def test_recomputation_replays_the_compiled_dropout():
    cfg = LLAMA.with_(pointwise_fusion=True, hidden_dropout=0.2)
    plain = model_step(cfg, COMPILED)
    for rc in (RecomputeConfig("full", "uniform", 1), RecomputeConfig("full", "block", 1)):
        assert_same_step(model_step(cfg, COMPILED, rc), plain, 0.0, rc.method)
    no_dropout = model_step(cfg.with_(hidden_dropout=0.0), COMPILED)
    assert (plain[0] - no_dropout[0]).abs() > 1e-4  # the dropout is there


def counting_backend(calls: list):
    """inductor's partitioner without code generation, counting each graph it compiles."""

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            calls.append(kind)
            return make_boxed_func(gm.forward)

        return compile_graph

    return aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        partition_fn=min_cut_rematerialization_partition,
    )


def test_nothing_compiles_after_the_warm_up_step_of_a_graphed_step():
    calls = []
    model = GPTModel(LLAMA.with_(pointwise_fusion=True))
    init_chunk(model, 1)
    with_backend(model, counting_backend(calls))
    graph = MicroBatchGraph(warmup_steps=1, capture=RecordOnly)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(4):
        tokens, labels = torch.randint(0, 100, (2, 2, 16), generator=g)
        batch = dict(tokens=tokens, labels=labels, loss_mask=torch.ones(2, 16))
        if not graph.begin_step():  # the warm-up step, eager
            loss = lm_loss(model(tokens=tokens, labels=labels), batch)
            loss.backward()
            warm_up = len(calls)
        else:
            graph.prepare(model, batch, lm_loss, None)
            loss = graph.replay(batch, 1.0)
        losses.append(loss.detach())
    # norm and rope_qk: a forward and a backward graph each (the pre-MLP norm runs apart from
    # the residual add, replayed in the backward); swiglu a forward without gradients (its
    # backward is swiglu_kernels.py; fc2's input again uses it too)
    assert warm_up == 5 and sorted(set(calls)) == ["backward", "forward"]
    assert len(calls) == warm_up and graph.captures == 1
    assert all(torch.isfinite(loss) for loss in losses)
