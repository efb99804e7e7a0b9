"""--pointwise-fusion under tensor and sequence parallelism (2 processes, gloo, CPU): the
compiled regions see local shards only, so tp 2 with sequence parallelism equals the plain
single-process model (loss, logits and every gradient), and with hidden dropout from the
tracker's per-rank stream, full recomputation gives the gradients of the step without it."""

import torch
import torch._dynamo

from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.core.recompute import RecomputeConfig
from megadyn.core.tensor_parallel import RNGTracker
from megadyn.models import GPTModel, init_chunk, masked_mean
from megadyn.testing import spawn
from tests.core.test_tp_parity import SEED, VARIANTS, batch, gather_global, reference, run_model
from tests.models.test_pointwise import COMPILED, with_backend


def fused_model(cfg, groups, **kw):
    model = GPTModel(cfg, tp_group=groups.tp_group, sequence_parallel=True, **kw)
    init_chunk(model, SEED)
    with_backend(model, COMPILED)
    return model


def tp_body(rank, world):
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # no silent eager fallback
    cfg = VARIANTS["llama"]
    ref_model, ref_logits, ref_loss = reference(cfg)
    groups = ParallelGroups.build(Layout(tp=2, sequence_parallel=True), range(world))
    model = fused_model(cfg.with_(pointwise_fusion=True), groups)
    logits, loss = run_model(model, groups.tp_group)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    grads = gather_global(model, {n: p.grad for n, p in model.named_parameters()}, groups.tp_group)
    for name, grad in ref_model.named_parameters():
        torch.testing.assert_close(grads[name], grad.grad, rtol=1e-4, atol=1e-6, msg=name)

    dropout = cfg.with_(pointwise_fusion=True, hidden_dropout=0.2, num_layers=3)
    runs = []
    for rc in (RecomputeConfig(), RecomputeConfig("full", "uniform", 2)):
        torch.manual_seed(5)
        tracker = RNGTracker.create(5, groups.tp_rank, 0, "cpu")
        model = fused_model(dropout, groups, recompute_cfg=rc, tracker=tracker)
        tokens, labels, mask = batch()
        loss = masked_mean(model(tokens, labels=labels), mask)
        loss.backward()
        runs.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss, grads), (again, regrads) = runs
    assert torch.equal(loss, again) and (loss - ref_loss).abs() > 1e-4  # dropped, the same
    for a, b in zip(grads, regrads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    groups.destroy()
    return True


def test_tensor_and_sequence_parallel_fused_steps_match_the_plain_model():
    assert all(spawn(tp_body, world=2))
