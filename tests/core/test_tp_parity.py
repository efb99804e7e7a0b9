"""Tensor-parallel GPT equals the single-process GPT: logits, loss and every gradient."""

import pytest
import torch
import torch.distributed as dist

from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.core.recompute import RecomputeConfig
from megadyn.core.tensor_parallel import RNGTracker
from megadyn.models import GPTConfig, GPTModel, init_chunk, masked_mean
from megadyn.models.sharding import param_specs, tp_piece
from megadyn.testing import spawn

SEED = 1234
VARIANTS = {
    "gpt2": GPTConfig.gpt2(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        vocab_size=100,
        make_vocab_size_divisible_by=8,
        max_position_embeddings=32,
    ),
    "llama": GPTConfig.llama(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=96,
        vocab_size=100,
        make_vocab_size_divisible_by=8,
        max_position_embeddings=32,
    ),
}


def batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 100, (2, 16), generator=g)
    labels = torch.randint(0, 100, (2, 16), generator=g)
    mask = (torch.rand(2, 16, generator=g) > 0.2).float()
    return tokens, labels, mask


def run_model(model, tp_group):
    tokens, labels, mask = batch()
    logits = model(tokens)
    loss = masked_mean(model(tokens, labels=labels), mask)
    loss.backward()
    for p in model.parameters():  # replicated params under sequence parallelism: sum over tp
        if getattr(p, "sequence_parallel", False) and tp_group is not None:
            dist.all_reduce(p.grad, group=tp_group)
    return logits.detach(), loss.detach()


def gather_global(model, tensors, tp_group):
    """Assemble global tensors from every tp rank's local pieces."""
    cfg = model.cfg
    specs = param_specs(cfg)
    tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    locals_ = [None] * tp
    dist.all_gather_object(locals_, {n: t.detach() for n, t in tensors.items()}, group=tp_group)
    out = {}
    for name in tensors:
        full = torch.zeros(specs[name].shape)
        for r in range(tp):
            tp_piece(specs[name], cfg, tp, r).put(full, locals_[r][name])
        out[name] = full
    del rank
    return out


def reference(cfg):
    model = GPTModel(cfg)
    init_chunk(model, SEED)
    logits, loss = run_model(model, None)
    return model, logits, loss


def body(rank, world, tp):
    layout_sp = [False, True] if tp > 1 else [False]
    for name, cfg in VARIANTS.items():
        ref_model, ref_logits, ref_loss = reference(cfg)
        ref_grads = {n: p.grad for n, p in ref_model.named_parameters()}
        for sp in layout_sp:
            groups = ParallelGroups.build(
                Layout(tp=tp, dp=world // tp, sequence_parallel=sp), range(world)
            )
            model = GPTModel(
                cfg,
                tp_group=groups.tp_group,
                sequence_parallel=sp,
            )
            init_chunk(model, SEED)
            logits, loss = run_model(model, groups.tp_group)
            what = f"{name} tp={tp} sp={sp}"
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=what)
            full_logits = [torch.empty(0)] * tp
            dist.all_gather_object(full_logits, logits, group=groups.tp_group)
            torch.testing.assert_close(
                torch.cat(full_logits, -1), ref_logits, rtol=1e-5, atol=1e-5, msg=what
            )
            grads = gather_global(
                model, {n: p.grad for n, p in model.named_parameters()}, groups.tp_group
            )
            assert grads.keys() == ref_grads.keys()
            for n, g in grads.items():
                torch.testing.assert_close(g, ref_grads[n], rtol=1e-5, atol=1e-6, msg=f"{what} {n}")
            groups.destroy()  # rebuilt with another layout in the next round


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_matches_single_process(tp):
    spawn(body, world=tp if tp > 1 else 2, args=(tp,))


def recompute_body(rank, world, granularity, method):
    cfg = VARIANTS["llama"].with_(num_layers=4, hidden_dropout=0.1, attention_dropout=0.1)
    groups = ParallelGroups.build(Layout(tp=2, sequence_parallel=True), range(world))
    grads = []
    for rc in (RecomputeConfig(), RecomputeConfig(granularity, method, 2 if method else None)):
        torch.manual_seed(5)
        tracker = RNGTracker.create(5, groups.tp_rank, 0, "cpu")
        model = GPTModel(
            cfg, tp_group=groups.tp_group, sequence_parallel=True, recompute_cfg=rc, tracker=tracker
        )
        init_chunk(model, SEED)
        tokens, labels, mask = batch()
        masked_mean(model(tokens, labels=labels), mask).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    "granularity,method", [("full", "uniform"), ("full", "block"), ("selective", None)]
)
def test_recompute_gives_identical_gradients_with_dropout(granularity, method):
    spawn(recompute_body, world=2, args=(granularity, method))


def dropout_body(rank, world):
    groups = ParallelGroups.build(Layout(tp=2), range(world))
    torch.manual_seed(11)  # default stream: same seed on all tp ranks
    tracker = RNGTracker.create(11, groups.tp_rank, 0, "cpu")
    x = torch.ones(1000)
    replicated = torch.nn.functional.dropout(x, 0.5)
    with tracker.fork():
        split = torch.nn.functional.dropout(x, 0.5)
    both = [None, None]
    dist.all_gather_object(both, (replicated, split), group=groups.tp_group)
    assert torch.equal(both[0][0], both[1][0]), "replicated-region masks must agree over tp"
    assert not torch.equal(both[0][1], both[1][1]), (
        "tensor-parallel-region masks must differ over tp"
    )
    # forking does not disturb the default stream
    torch.manual_seed(11)
    torch.nn.functional.dropout(x, 0.5)
    assert (
        torch.equal(torch.nn.functional.dropout(x, 0.5), torch.nn.functional.dropout(x, 0.5))
        is False
    )


def test_dropout_masks_follow_tracker_rules():
    spawn(dropout_body, world=2)


def vocab_body(rank, world):
    groups = ParallelGroups.build(Layout(tp=2), range(world))
    cfg = VARIANTS["gpt2"].with_(make_vocab_size_divisible_by=128)  # 100 rows padded to 256
    try:
        GPTModel(cfg, tp_group=groups.tp_group)
    except ValueError as e:
        return str(e)
    return None


def test_vocabulary_that_does_not_fit_tp_is_refused():
    messages = spawn(vocab_body, world=2)
    assert messages[1] is not None and "--tensor-model-parallel-size" in messages[1]
