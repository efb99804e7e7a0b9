"""FP8 linear layers under --pointwise-fusion keep nothing of their inputs (megadyn/core/
recomputed.py, fp8.py): the backward computes them again (fc2's, SwiGLU's output, from fc1's
output; linear_qkv's and linear_fc1's, the norms' outputs, from the norms' inputs;
linear_proj's from the attention's output) and, tensorwise, casts x^T to fp8 at the scale the
forward saved. On the CPU (compiled as test_pointwise.py does):

- a Llama step's loss and every gradient equal, bit for bit, the step with the
  recomputation off, for each recipe;
- what the forward keeps for the backward is smaller by the four layers' fp8 x^T (tensorwise:
  one byte per token and input element of each) or their 16-bit inputs (rowwise and bf16:
  two; linear_proj's is a view of the attention's output, which is kept anyway);
- one layer: the backward gets x^T from the scope, or, where an inner saved-tensor hook keeps
  the input itself, casts it at the saved scale; the same gradients either way;
- tp 2 with and without sequence parallelism (spawned, gloo): training steps with and without
  the recomputation give the same losses and main_grads (under sequence parallelism
  linear_qkv and linear_fc1 keep their gathered inputs: only linear_proj and fc2 recompute).
"""

import contextlib
import dataclasses

import pytest
import torch
import torch._dynamo
from torch.autograd.graph import saved_tensors_hooks

import megadyn.core.recomputed as scope
import megadyn.models.transformer as transformer
from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.core.tensor_parallel.fp8 import Fp8Recipe
from megadyn.models import GPTModel, init_chunk
from megadyn.testing import spawn
from megadyn.training.build import build_model_parts
from tests.core.test_fp8 import MICRO, assert_equal_steps, fp8_job, train
from tests.models.test_pointwise import COMPILED, LLAMA, model_step, with_backend

RECIPES = [Fp8Recipe("e4m3"), Fp8Recipe("hybrid"), Fp8Recipe("e4m3", "rowwise")]
TOKENS = 2 * 16  # model_step's micro batch 2 x sequence 16


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


def fp8_llama(recipe: Fp8Recipe):
    return LLAMA.with_(
        params_dtype=torch.bfloat16,
        pointwise_fusion=True,
        fp8_format=recipe.format,
        fp8_recipe=recipe.recipe,
    )


@contextlib.contextmanager
def recomputation_off():
    original = transformer.recomputed_in_backward
    transformer.recomputed_in_backward = lambda *a: contextlib.nullcontext()
    try:
        yield
    finally:
        transformer.recomputed_in_backward = original


@contextlib.contextmanager
def records(derived: list):
    """Appends, for each saved tensor the scopes replace, whether the backward derives
    another tensor from it (tensorwise fc2: x^T in fp8)."""
    original = scope._Recomputed.__init__

    def counting(self, t, base_offset, derive=None):
        derived.append(derive is not None)
        original(self, t, base_offset, derive)

    scope._Recomputed.__init__ = counting
    try:
        yield derived
    finally:
        scope._Recomputed.__init__ = original


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.format}-{r.recipe}")
def test_fp8_step_with_linear_inputs_recomputed_equals_keeping_them(recipe):
    cfg = fp8_llama(recipe)
    with records([]) as derived:
        loss, grads = model_step(cfg, COMPILED)
    # four records per layer (qkv, proj, fc1, fc2's inputs); tensorwise turns each into x^T
    # in fp8 in the backward
    assert derived == [recipe.recipe == "tensorwise"] * 4 * cfg.num_layers
    with recomputation_off():
        kept_loss, kept_grads = model_step(cfg, COMPILED)
    assert torch.equal(loss, kept_loss)
    assert list(grads) == list(kept_grads)
    for name, grad in grads.items():
        assert torch.equal(grad, kept_grads[name]), name


def kept_by_forward(cfg) -> int:
    """Bytes of the distinct storages that one micro batch's forward saves for the backward
    (the parameters included: the same in every run)."""
    kept = {}

    def keep(t):
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    def counted(pack, unpack):  # the scope's own hooks, counting what they keep
        return saved_tensors_hooks(lambda t: keep(pack(t)), unpack)

    torch.manual_seed(5)
    model = GPTModel(cfg)
    init_chunk(model, 1)
    with_backend(model, COMPILED)
    tokens, labels = torch.randint(0, 100, (2, 2, 16), generator=torch.Generator().manual_seed(0))
    original = scope.saved_tensors_hooks
    scope.saved_tensors_hooks = counted
    try:
        with saved_tensors_hooks(keep, lambda t: t):
            loss = model(tokens, labels=labels).float().mean()
    finally:
        scope.saved_tensors_hooks = original
    loss.backward()  # the graph was whole
    return sum(kept.values())


@pytest.mark.parametrize("recipe", [*RECIPES, None], ids=lambda r: r and f"{r.format}-{r.recipe}")
def test_the_linear_layers_keep_no_copy_of_their_inputs(recipe):
    cfg = fp8_llama(recipe) if recipe else LLAMA.with_(params_dtype=torch.bfloat16)
    cfg = cfg.with_(pointwise_fusion=True)
    recomputing = kept_by_forward(cfg)
    with recomputation_off():
        keeping = kept_by_forward(cfg)
    h, ffn = cfg.hidden_size, cfg.ffn_size
    if recipe is not None and recipe.recipe == "tensorwise":  # x^T in fp8, 1 byte
        assert keeping - recomputing == cfg.num_layers * TOKENS * (3 * h + ffn)
    else:  # the bf16 inputs, 2 bytes; linear_proj's is a view of the attention's output
        assert keeping - recomputing == cfg.num_layers * TOKENS * (2 * h + ffn) * 2


@pytest.mark.parametrize("inner_hook", [False, True])
def test_a_tensorwise_layer_gets_x_t_back_or_casts_the_input_it_kept(inner_hook):
    """Under the scope a tensorwise FP8 layer saves its input and the scale: the scope hands
    its backward x^T in fp8 cast again from the recomputed input; where an inner saved-tensor
    hook keeps the input itself instead, the backward casts it at the same scale. Either way
    the gradients are those of the layer that kept x^T."""
    from megadyn.core.tensor_parallel import RowParallelLinear
    from megadyn.models.pointwise import swiglu

    gen = torch.Generator().manual_seed(2)
    layer = RowParallelLinear(96, 64, None, bias=False, fp8=Fp8Recipe("e4m3"))
    with torch.no_grad():
        layer.weight.copy_(torch.randn(64, 96, generator=gen) * 0.05)
    y0, g = torch.randn(16, 2, 192, generator=gen), torch.randn(16, 2, 64, generator=gen)
    grads = []
    for recompute in (False, True):
        y = y0.clone().requires_grad_()
        layer.weight.grad = None
        h = swiglu(y)
        with contextlib.ExitStack() as stack:
            if recompute:
                stack.enter_context(scope.recomputed_in_backward(h, swiglu, y))
            if recompute and inner_hook:
                stack.enter_context(saved_tensors_hooks(lambda t: t, lambda t: t))
            out = layer(h)
        out.backward(g)
        grads.append((out.detach(), y.grad, layer.weight.grad))
    for got, want in zip(*grads):
        assert torch.equal(got, want)


TP_CASES = [  # (recipe or None: bf16, sequence parallelism)
    (Fp8Recipe("hybrid"), True),
    (Fp8Recipe("e4m3", "rowwise"), True),
    (None, False),
    (Fp8Recipe("hybrid"), False),
]


def tp_body(rank, world):
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    cpu = torch.device("cpu")
    for recipe, sp in TP_CASES:
        groups = ParallelGroups.build(Layout(tp=2, sequence_parallel=sp), range(world))
        job = fp8_job(recipe or Fp8Recipe(), 1, seed=7)
        model = job.model.with_(pointwise_fusion=True)
        job = dataclasses.replace(job, model=model if recipe else model.with_(fp8_format=None))
        runs, derived = [], []
        for off in (False, True):
            parts = build_model_parts(job, job.model, groups, cpu)
            for chunk in parts.chunks:
                with_backend(chunk, COMPILED)
            with recomputation_off() if off else records(derived):
                runs.append(train(parts, groups, range(2)))
        what = f"{recipe} tp2 sp {sp}"
        # the inputs of each layer and micro batch replaced by records (tensorwise: x^T):
        # proj's and fc2's, and without sequence parallelism qkv's and fc1's
        records_per_run = 2 * MICRO * job.model.num_layers * (2 if sp else 4)
        tensorwise = recipe is not None and recipe.recipe == "tensorwise"
        assert derived == [tensorwise] * records_per_run, what
        assert_equal_steps(runs[0], runs[1], what)
        groups.destroy()
    return True


def test_tp2_training_with_linear_inputs_recomputed_equals_keeping_them():
    assert all(spawn(tp_body, world=2))
