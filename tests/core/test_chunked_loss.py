"""--cross-entropy-chunks (megadyn/core/tensor_parallel/chunked_loss.py): the output layer and
its cross entropy over chunks of tokens give the whole logits' per-token losses and gradients
(single process, tied and untied output weights; tp 2 with and without sequence parallelism;
the weight gradient added into an fp32 main_grad), the forward keeps no logits, and training
through the Trainer (dp 2, distributed optimizer, ZeRO-1 and ZeRO-2, bf16) follows the
unchunked run. The chunks' GEMMs may sum in another order than the whole GEMM: fp32 values
agree to 1e-5 relative."""

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import megadyn.core.tensor_parallel.chunked_loss as chunked_loss
from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.models import GPTModel, init_chunk, masked_mean
from megadyn.testing import spawn
from tests.core.test_sharded_grads import _run, _trainer
from tests.core.test_tp_parity import VARIANTS, batch, gather_global

CHUNKS = 3  # uneven over the batch's 2 x 16 tokens


def step(cfg, groups=None, main_grad=False):
    """(per-token losses, gradients by name) of one backward of the masked mean loss."""
    tp_group = groups.tp_group if groups else None
    sp = groups.layout.sequence_parallel if groups else False
    model = GPTModel(cfg, tp_group=tp_group, sequence_parallel=sp)
    init_chunk(model, 1234)
    if main_grad:  # as DDP gives them: the output layer's gradient goes into it
        for p in model.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    tokens, labels, mask = batch()
    per_token = model(tokens, labels=labels)
    masked_mean(per_token, mask).backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.main_grad if getattr(p, "grad_added_to_main_grad", False) else p.grad
        if sp and getattr(p, "sequence_parallel", False):  # replicated over tp: partial sums
            torch.distributed.all_reduce(grad, group=tp_group)
        grads[name] = grad.float()
    if groups is not None:
        grads = gather_global(model, grads, tp_group)
    return per_token.detach().float(), grads


def assert_same(whole, chunked, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(chunked[0], whole[0], rtol=rtol, atol=atol)
    assert list(chunked[1]) == list(whole[1])
    for name, grad in whole[1].items():
        torch.testing.assert_close(chunked[1][name], grad, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("variant", ["gpt2", "llama"])  # tied, untied output weight
def test_chunks_give_the_whole_logits_loss_and_gradients(variant):
    cfg = VARIANTS[variant]
    assert_same(step(cfg), step(cfg.with_(cross_entropy_chunks=CHUNKS)))
    assert_same(step(cfg), step(cfg.with_(cross_entropy_chunks=64)))  # more chunks than tokens


def test_the_weight_gradient_goes_into_main_grad():
    cfg = VARIANTS["llama"].with_(params_dtype=torch.bfloat16)
    whole = step(cfg, main_grad=True)
    chunked = step(cfg.with_(cross_entropy_chunks=CHUNKS), main_grad=True)
    # bf16 logits: a chunk's rows may round differently from the whole GEMM's
    assert_same(whole, chunked, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("variant", ["gpt2", "llama"])  # tied, untied output weight
def test_fused_gradients_into_main_grad_equal_autograd_s(variant):
    """Every gradient a bf16 model adds into its fp32 main_grad itself (the linear layers', an
    untied embedding table's row by row) equals autograd's; a tied table's two terms (lookup
    and output layer) are summed by autograd, none is lost. bf16 gradients: to bf16 rounding."""
    cfg = VARIANTS[variant].with_(params_dtype=torch.bfloat16)
    fused = step(cfg, main_grad=True)
    plain = step(cfg.with_(gradient_accumulation_fusion=False), main_grad=True)
    assert_same(plain, fused, rtol=2e-2, atol=2e-3)


def saved_shapes(cfg) -> list[tuple]:
    shapes = []

    def keep(t):
        shapes.append(tuple(t.shape))
        return t

    model = GPTModel(cfg)
    init_chunk(model, 1)
    tokens, labels, _ = batch()
    with saved_tensors_hooks(keep, lambda t: t):
        loss = model(tokens, labels=labels).sum()
    loss.backward()
    return shapes


def test_the_forward_keeps_no_logits():
    cfg = VARIANTS["llama"]
    logits = (16, 2, cfg.vocab_size)  # [s, b, V] (tp 1: the unpadded rows)
    assert logits in saved_shapes(cfg)
    chunked = saved_shapes(cfg.with_(cross_entropy_chunks=CHUNKS))
    assert not [s for s in chunked if s[-1] == logits[-1] and s[0] > 1], chunked


def test_chunks_below_one_are_refused():
    with pytest.raises(ValueError, match="--cross-entropy-chunks"):
        VARIANTS["llama"].with_(cross_entropy_chunks=0)


def tp_body(rank, world):
    for variant in ("gpt2", "llama"):
        cfg = VARIANTS[variant]
        for sp in (False, True):
            groups = ParallelGroups.build(Layout(tp=2, sequence_parallel=sp), range(world))
            whole = step(cfg, groups)
            assert_same(whole, step(cfg.with_(cross_entropy_chunks=CHUNKS), groups))
            groups.destroy()
    return True


def trainer_body(rank, world):
    flags = ("--bf16", "--untie-embeddings-and-output-weights")  # the output layer's own weight
    for strategy in ("optim", "optim_grads"):
        whole = _run(_trainer(world, strategy, *flags))
        trainer = _trainer(world, strategy, *flags, "--cross-entropy-chunks", str(CHUNKS))
        assert [c.cfg.cross_entropy_chunks for c in trainer.chunks] == [CHUNKS]
        fused = []  # the chunks' weight gradients went into the output layer's main_grad
        original = chunked_loss.weight_grad
        chunked_loss.weight_grad = lambda w, *a, f=fused, o=original: f.append(1) or o(w, *a)
        try:
            chunked = _run(trainer)
        finally:
            chunked_loss.weight_grad = original
        assert len(fused) == 3 * 4 * CHUNKS  # steps x micro batches x chunks
        for a, b in zip(whole[0], chunked[0]):  # losses
            assert abs(a - b) <= 1e-2 * abs(a), (strategy, whole[0], chunked[0])
        for a, b in zip(whole[2], chunked[2]):  # gradient norms
            assert abs(a - b) <= 2e-2 * abs(a), (strategy, whole[2], chunked[2])
    return True


def test_tp2_and_dp2_training_with_chunks_follow_the_whole_logits():
    """One spawned job each (processes start slowly): tp 2 with and without sequence
    parallelism; the Trainer at dp 2, ZeRO-1 and ZeRO-2, bf16 with main_grad fusion."""
    assert all(spawn(tp_body, world=2))
    assert all(spawn(trainer_body, world=2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_chunks_follow_the_whole_logits_with_the_fused_kernels():
    """bf16 on CUDA: the fused cross entropy's kernels per chunk (its gradient written over the
    chunk's logits), the weight gradient into an fp32 main_grad by cuBLAS; a peak that holds
    one chunk's logits, not the whole."""
    cfg = VARIANTS["llama"].with_(params_dtype=torch.bfloat16, vocab_size=32000)
    tokens = torch.randint(0, 32000, (4, 32), device="cuda")
    runs = []
    for chunks in (1, 4):
        model = GPTModel(cfg.with_(cross_entropy_chunks=chunks), device="cuda")
        init_chunk(model, 1)
        for p in model.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        per_token = model(tokens, labels=tokens)
        per_token.mean().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        grads = {
            n: p.main_grad if getattr(p, "grad_added_to_main_grad", False) else p.grad.float()
            for n, p in model.named_parameters()
        }
        runs.append((per_token.detach(), grads, peak))
    (whole, whole_grads, whole_peak), (chunked, chunked_grads, chunked_peak) = runs
    torch.testing.assert_close(chunked, whole, rtol=2e-2, atol=2e-2)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=5e-2, atol=1e-3, msg=name)
    logits = 4 * 32 * 32000 * 2  # [b, s, V] bf16
    assert whole_peak - chunked_peak >= logits // 2, (whole_peak, chunked_peak)
