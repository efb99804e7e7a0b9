"""Optimizer parity over layouts: ZeRO-1 on/off, tp/pp gradient norms, loss scaling, state."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megadyn.core.distributed import DistributedDataParallel, finalize_model_grads
from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.core.optimizer import (
    OptimizerConfig,
    OptimizerStep,
    StepInterrupted,
    build_optimizer,
    uses_weight_decay,
)
from megadyn.testing.spawn import spawn

CONFIG = dict(lr=1e-2, weight_decay=0.1, clip_grad=0.05)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # 104 + 26 + 70 = 200 elements: not a multiple of any dp size tested
    return nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.GELU(), nn.Linear(13, 5))


def make_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 7, generator=g), torch.randn(n, 5, generator=g)


def reference_adamw(model: nn.Module) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if uses_weight_decay(n, p)]
    no_decay = [p for n, p in model.named_parameters() if not uses_weight_decay(n, p)]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=CONFIG["lr"], weight_decay=CONFIG["weight_decay"])


def wrap(groups, use_distributed_optimizer: bool, config=CONFIG, bucket_size=64):
    ddp = DistributedDataParallel(
        make_model(),
        groups.dp_group,
        overlap_grad_reduce=True,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
    )
    cfg = OptimizerConfig(**config, use_distributed_optimizer=use_distributed_optimizer)
    return ddp, build_optimizer([ddp], [ddp], groups, cfg)


def train(ddp, opt, groups, steps: int, first_seed: int = 10) -> list[float]:
    norms = []
    rank, dp = groups.dp_rank, groups.dp_size
    for step in range(steps):
        x, y = make_batch(2 * dp, seed=first_seed + step)
        opt.zero_grad()
        nn.functional.mse_loss(
            ddp(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2]
        ).backward()
        finalize_model_grads([ddp], groups)
        step = opt.step()
        applied, norm = step.applied, step.grad_norm
        assert applied
        norms.append(norm)
    return norms


def _zero1_parity(rank, world):
    groups = ParallelGroups.build(Layout(dp=world), range(world))
    ddp_off, opt_off = wrap(groups, False)
    ddp_on, opt_on = wrap(groups, True)
    norms_off = train(ddp_off, opt_off, groups, steps=4)
    norms_on = train(ddp_on, opt_on, groups, steps=4)
    ref = make_model()
    ref_opt = reference_adamw(ref)
    for step in range(4):
        x, y = make_batch(2 * world, seed=10 + step)
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CONFIG["clip_grad"])
        ref_opt.step()
        assert (
            abs(norm.item() - norms_on[step]) < 1e-6
            and abs(norms_off[step] - norms_on[step]) < 1e-6
        )
    for p_off, p_on, p_ref in zip(ddp_off.parameters(), ddp_on.parameters(), ref.parameters()):
        torch.testing.assert_close(p_on, p_off, rtol=0, atol=1e-6)
        torch.testing.assert_close(p_on, p_ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_optimizer_matches_replicated_and_single_process(world):
    spawn(_zero1_parity, world=world)


# --- tensor parallel: norms count replicated params once; sequence-parallel grads are summed --
def _full_tp_model(seed=0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {
        "ln": 1 + 0.1 * torch.randn(6),  # replicated, sequence parallel
        "w1": torch.randn(8, 6),  # column parallel: split dim 0
        "b1": torch.randn(8),  # column parallel bias: split dim 0
        "w2": torch.randn(5, 8),  # row parallel: split dim 1
        "b2": torch.randn(5),  # row parallel bias: replicated, sequence parallel
    }


def _full_tp_grads() -> dict[str, torch.Tensor]:
    params = {k: v.requires_grad_() for k, v in _full_tp_model().items()}
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    h = torch.relu((x * params["ln"]) @ params["w1"].T + params["b1"])
    (h @ params["w2"].T + params["b2"]).square().mean().backward()
    return {k: v.grad for k, v in params.items()}


SPLIT = {"ln": -1, "w1": 0, "b1": 0, "w2": 1, "b2": -1}


class ShardedModel(nn.Module):
    def __init__(self, tp_rank: int, tp: int):
        super().__init__()
        for name, full in _full_tp_model().items():
            dim = SPLIT[name]
            local = full if dim < 0 else full.chunk(tp, dim)[tp_rank]
            param = nn.Parameter(local.clone())
            param.tensor_model_parallel = dim >= 0
            param.partition_dim = dim
            param.sequence_parallel = dim < 0
            self.register_parameter(name, param)


def _tp_norm(rank, world, tp, use_distributed_optimizer):
    layout = Layout(tp=tp, dp=world // tp, sequence_parallel=True)
    groups = ParallelGroups.build(layout, range(world))
    model = ShardedModel(groups.tp_rank, tp)
    ddp = DistributedDataParallel(
        model, groups.dp_group, use_distributed_optimizer=use_distributed_optimizer, bucket_size=20
    )
    cfg = OptimizerConfig(**CONFIG, use_distributed_optimizer=use_distributed_optimizer)
    opt = build_optimizer([ddp], [ddp], groups, cfg)
    grads = _full_tp_grads()
    for name, p in model.named_parameters():
        dim = SPLIT[name]
        if dim < 0:  # each tp rank saw part of the sequence: partial sums that add up to the grad
            weight = (groups.tp_rank + 1) / (tp * (tp + 1) / 2)
            p.main_grad.copy_(grads[name] * weight)
        else:
            p.main_grad.copy_(grads[name].chunk(tp, dim)[groups.tp_rank])
    finalize_model_grads([ddp], groups)
    norm = opt.step().grad_norm
    expected = torch.linalg.vector_norm(torch.cat([g.view(-1) for g in grads.values()]))
    assert abs(norm - expected.item()) < 1e-5 * expected.item(), (norm, expected)
    # the step equals a clipped AdamW step of the full model
    ref = ShardedModel(tp_rank=0, tp=1)
    for name, p in ref.named_parameters():
        p.grad = grads[name].clone()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), CONFIG["clip_grad"])
    reference_adamw(ref).step()
    for (name, p), full in zip(model.named_parameters(), ref.parameters()):
        dim = SPLIT[name]
        expected = full.detach() if dim < 0 else full.detach().chunk(tp, dim)[groups.tp_rank]
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("tp,world,zero1", [(2, 2, False), (2, 4, True)])
def test_grad_norm_tensor_parallel(tp, world, zero1):
    spawn(_tp_norm, world=world, args=(tp, zero1))


# --- tied embeddings over two pipeline stages --------------------------------------------------
VOCAB, HIDDEN = 11, 6


def _embedding_init() -> tuple[torch.Tensor, nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    return torch.randn(VOCAB, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)


class FirstStage(nn.Module):
    def __init__(self):
        super().__init__()
        weight, self.proj, _ = _embedding_init()
        self.embedding = nn.Parameter(weight.clone())
        self.embedding.tensor_model_parallel, self.embedding.partition_dim = True, 0

    def shared_embedding_or_output_weight(self) -> nn.Parameter:
        return self.embedding

    def forward(self, tokens):
        return self.proj(self.embedding[tokens]).square().mean()


class LastStage(nn.Module):
    def __init__(self):
        super().__init__()
        weight, _, self.proj = _embedding_init()
        self.output = nn.Parameter(weight.clone())
        self.output.tensor_model_parallel, self.output.partition_dim = True, 0
        self.output.shared_embedding = True
        self.norm = nn.LayerNorm(HIDDEN)  # the stages' buffers differ but must shard alike

    def forward(self, hidden):
        return torch.logsumexp(self.proj(self.norm(hidden)) @ self.output.T, dim=-1).mean()


def _embedding_data():
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, VOCAB, (4,), generator=g), torch.randn(4, HIDDEN, generator=g)


def _tied_embedding(rank, world, zero1):
    groups = ParallelGroups.build(Layout(pp=2, dp=world // 2), range(world))
    stage = FirstStage() if groups.is_first_stage else LastStage()
    ddp = DistributedDataParallel(
        stage,
        groups.dp_group,
        overlap_grad_reduce=True,
        use_distributed_optimizer=zero1,
        bucket_size=50,
    )
    opt = build_optimizer(
        [ddp], [ddp], groups, OptimizerConfig(**CONFIG, use_distributed_optimizer=zero1)
    )
    tokens, hidden = _embedding_data()
    ddp(tokens if groups.is_first_stage else hidden).backward()
    finalize_model_grads([ddp], groups)
    norm = opt.step().grad_norm

    # one process: a single embedding used by both stages
    first, last = FirstStage(), LastStage()
    last.output = first.embedding
    (first(tokens) + last(hidden)).backward()
    params = list(first.parameters()) + list(last.proj.parameters()) + list(last.norm.parameters())
    expected = torch.nn.utils.clip_grad_norm_(params, CONFIG["clip_grad"])
    assert abs(norm - expected.item()) < 1e-5 * expected.item(), (norm, expected)
    torch.optim.AdamW(params, lr=CONFIG["lr"], weight_decay=CONFIG["weight_decay"]).step()
    mine = stage.embedding if groups.is_first_stage else stage.output
    torch.testing.assert_close(mine.detach(), first.embedding.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("world,zero1", [(2, False), (4, True)])
def test_tied_embedding_over_pipeline_stages(world, zero1):
    spawn(_tied_embedding, world=world, args=(zero1,))


# --- fp16 dynamic loss scaling ---------------------------------------------------------------------
def _loss_scaler(rank, world):
    groups = ParallelGroups.build(Layout(dp=world), range(world))
    zero1 = world > 1
    ddp = DistributedDataParallel(
        make_model().half(), groups.dp_group, use_distributed_optimizer=zero1, bucket_size=64
    )
    config = dict(fp16=True, initial_loss_scale=1024.0, hysteresis=1, loss_scale_window=2)
    cfg = OptimizerConfig(**{**CONFIG, **config}, use_distributed_optimizer=zero1)
    opt = build_optimizer([ddp], [ddp], groups, cfg)
    before = [p.detach().clone() for p in ddp.parameters()]
    # rank 0 overflows in an element that, with ZeRO-1, only the last dp rank owns after the
    # reduce-scatter: the other ranks must learn of it and skip too
    bucket = ddp.buffers[0].buckets[0]
    owned_by_last = bucket.shard_range(world - 1)[0]
    assert any(s <= owned_by_last < e for s, e in bucket.param_ranges.values())
    if rank == 0:
        bucket.grad_data[owned_by_last] = float("inf")
    finalize_model_grads([ddp], groups)
    assert opt.step() == OptimizerStep(applied=False)
    assert opt.loss_scale == 512.0
    assert all(torch.equal(a, b) for a, b in zip(before, ddp.parameters()))

    x, y = make_batch(2, seed=3)
    ref = make_model()
    nn.functional.mse_loss(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).item()
    for step in range(2):
        opt.zero_grad()
        out = ddp(x.half()).float()
        opt.scale_loss(nn.functional.mse_loss(out, y)).backward()
        finalize_model_grads([ddp], groups)
        step = opt.step()
        applied, norm = step.applied, step.grad_norm
        assert applied
        if step == 0:  # the norm of the unscaled grads
            assert abs(norm - ref_norm) < 1e-2 * ref_norm, (norm, ref_norm)
    assert opt.loss_scale == 1024.0  # doubled after loss_scale_window good steps
    assert not any(torch.equal(a, b) for a, b in zip(before, ddp.parameters()))


@pytest.mark.parametrize("world", [1, 2])
def test_fp16_loss_scaler_skips_overflow_and_rescales(world):
    spawn(_loss_scaler, world=world)


def _interrupted_step(rank, world):
    """A step whose communicators were aborted (a peer died) changes nothing: the survivor
    keeps the previous step's params, Adam state, step count and loss scale."""
    groups = ParallelGroups.build(Layout(dp=world), range(world))
    for fp16 in (False, True):
        model = make_model().half() if fp16 else make_model()
        ddp = DistributedDataParallel(
            model, groups.dp_group, use_distributed_optimizer=True, bucket_size=64
        )
        extra = dict(fp16=True, initial_loss_scale=8.0, loss_scale_window=1) if fp16 else {}
        opt = build_optimizer(
            [ddp], [ddp], groups, OptimizerConfig(**CONFIG, **extra, use_distributed_optimizer=True)
        )
        x, y = make_batch(2, seed=5)
        for step in range(2):
            opt.zero_grad()
            out = ddp(x.half() if fp16 else x).float()
            opt.scale_loss(nn.functional.mse_loss(out, y)).backward()
            finalize_model_grads([ddp], groups)
            if step == 0:
                assert opt.step().applied
                params = [p.detach().clone() for p in ddp.parameters()]
                state = [opt.param_state(p) for p in opt.params]
                count, scale = opt.step_count, opt.loss_scale
        opt.interrupted = True
        with pytest.raises(StepInterrupted, match="stops before its update"):
            opt.step()
        assert opt.step_count == count and opt.loss_scale == scale
        assert all(torch.equal(a, b) for a, b in zip(params, ddp.parameters()))
        for before, p in zip(state, opt.params):
            after = opt.param_state(p)
            assert all(torch.equal(before[k], after[k]) for k in before)


def test_an_interrupted_step_changes_nothing():
    spawn(_interrupted_step, world=2)


# --- layout-free optimizer state -------------------------------------------------------------------
def _bits(state: dict) -> list:
    return [state["step"]] + [
        t.view(torch.int32).clone() for p in state["params"] for t in p.values()
    ]


def _assert_same_bits(a: dict, b: dict) -> None:
    assert all(
        x == y if isinstance(x, int) else torch.equal(x, y) for x, y in zip(_bits(a), _bits(b))
    )


def _state_round_trip(rank, world):
    dp4 = ParallelGroups.build(Layout(dp=4), range(4))
    dp2 = ParallelGroups.build(Layout(dp=2), [0, 1])
    ddp_a, opt_a = wrap(dp4, True)
    train(ddp_a, opt_a, dp4, steps=2)
    state_a = opt_a.state_dict()  # gathered over dp: the same on every rank
    assert state_a["step"] == 2 and state_a["params"][0]["main"].shape == (13, 7)

    ddp_b, opt_b = wrap(dp4, False)  # ZeRO-1 off
    opt_b.load_state_dict(state_a)
    _assert_same_bits(opt_b.state_dict(), state_a)
    assert all(torch.equal(a, b) for a, b in zip(ddp_a.parameters(), ddp_b.parameters()))

    state_c = [None]
    if dp2.is_member:  # ZeRO-1 over dp 2
        ddp_c, opt_c = wrap(dp2, True)
        opt_c.load_state_dict(state_a)
        state_c = [opt_c.state_dict()]
        _assert_same_bits(state_c[0], state_a)
    dist.broadcast_object_list(state_c, src=0)
    ddp_d, opt_d = wrap(dp4, True)  # and back to dp 4
    opt_d.load_state_dict(state_c[0])
    _assert_same_bits(opt_d.state_dict(), state_a)

    # the reloaded optimizers keep training like the original
    norms = [train(d, o, dp4, steps=1, first_seed=50) for d, o in ((ddp_a, opt_a), (ddp_d, opt_d))]
    assert norms[0] == norms[1]
    for p_a, p_d in zip(ddp_a.parameters(), ddp_d.parameters()):
        assert torch.equal(p_a, p_d)


def test_param_state_round_trips_bit_exactly_across_zero1_and_dp():
    spawn(_state_round_trip, world=4)
