"""--use-precision-aware-optimizer: bf16 weight + int16 remainder in place of an fp32 main copy.

The encoding round-trips fp32 bits exactly (NaN and inf too); a step is bit for bit torch's
AdamW on the joined fp32 main value; the layout-free state is the same fp32 main in both
modes, so state moves between them (and over dp / ZeRO-1) exactly; no fp32 main is kept.
"""

import pytest
import torch
from torch import nn

from megadyn.core.distributed import DistributedDataParallel, finalize_model_grads
from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.core.optimizer import (
    OptimizerConfig,
    StepInterrupted,
    build_optimizer,
    uses_weight_decay,
)
from megadyn.core.optimizer.remainders import join, model_weight, split
from megadyn.core.optimizer.shards import STATE_KEYS
from megadyn.testing.spawn import spawn
from megadyn.training.arguments import ConfigError, parse_args
from megadyn.training.tensors import adopt_tensors, export_tensors
from tests.tiny import tiny_args

CONFIG = dict(lr=1e-2, weight_decay=0.1, clip_grad=0.0, bf16=True)


# --- the encoding ---------------------------------------------------------------------------------
def _reference_split(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hi = (b + 0x8000) >> 16, lo = b - (hi << 16), in int64 (no overflow)."""
    b = bits.long()
    hi = (b + 0x8000) >> 16
    lo = b - (hi << 16)
    return hi, lo


def _values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    scales = torch.logspace(-45, 38, 20000, dtype=torch.float64).float()
    random = torch.randn(20000, generator=g) * scales
    special = torch.tensor(
        [0x0, 0x80000000, 0x1, 0x80000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF]
        + [0x7F7F8000, 0x7F7F7FFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000]
        + [0x7FFF8000, 0x7FFFFFFF, 0xFFFFFFFF, 0x3F808000, 0x3F818000, 0xBF808000],
        dtype=torch.int64,
    )
    special = torch.where(special >= 2**31, special - 2**32, special).int().view(torch.float32)
    # every low half under a few high halves: all ties, all roundings
    high = torch.tensor([0x0000, 0x3F80, 0x3F81, 0xBF80, 0x7F7F, 0x8000], dtype=torch.int64)
    every = (high[:, None] << 16) + torch.arange(2**16)
    every = torch.where(every >= 2**31, every - 2**32, every).int().view(torch.float32)
    return torch.cat([random, special, every.view(-1)])


def test_split_join_round_trips_bit_exactly():
    x = _values()
    weight, remainder = split(x)
    assert weight.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert torch.equal(join(weight, remainder).view(torch.int32), x.view(torch.int32))
    hi, lo = _reference_split(x.view(torch.int32))
    finite = torch.isfinite(x)  # and no NaN whose sum wraps
    assert torch.equal(weight.view(torch.int16)[finite].long(), hi[finite])
    assert torch.equal(remainder.long()[finite], lo[finite])
    assert lo.min() >= -0x8000 and lo.max() <= 0x7FFF
    # the weight is a cast to bf16 except at exact ties, where it rounds away from zero
    tie = (x.view(torch.int32) & 0xFFFF) == 0x8000
    ok = finite & ~tie
    assert torch.equal(weight[ok].view(torch.int16), x[ok].to(torch.bfloat16).view(torch.int16))
    magnitude = weight.float().abs()
    assert bool((magnitude[tie & finite] > x[tie & finite].abs()).all())
    # NaN stays NaN, except where the sum wraps (high half all ones, low half >= 0x8000)
    bits = x.view(torch.int32)
    wraps = ((bits >> 16 & 0x7FFF) == 0x7FFF) & ((bits & 0x8000) != 0)
    assert torch.isnan(weight[torch.isnan(x) & ~wraps]).all()
    assert (weight[wraps] == 0).all() and wraps.sum() == 3  # a signed zero
    assert torch.equal(
        model_weight(x.view(4, -1)).view(-1).view(torch.int16), weight.view(torch.int16)
    )


# --- one process: the step is torch's AdamW on the joined main ------------------------------------
class Net(nn.Module):
    """bf16 layers and one fp32 param (it keeps an fp32 main: a view of itself)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.norm, self.lin2 = nn.Linear(7, 13), nn.LayerNorm(13), nn.Linear(13, 5)
        self.to(torch.bfloat16)
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(5))

    def forward(self, x):
        return self.lin2(nn.functional.gelu(self.norm(self.lin1(x)))).float() * self.gain


def wrap(groups, flag: bool, distopt: bool = False, **extra):
    ddp = DistributedDataParallel(
        Net(), groups.dp_group, use_distributed_optimizer=distopt, bucket_size=64
    )
    cfg = OptimizerConfig(
        **{**CONFIG, **extra}, use_distributed_optimizer=distopt, use_precision_aware_optimizer=flag
    )
    opt = build_optimizer([ddp], [ddp], groups, cfg)
    opt.scratch_numel = 40  # several joins per step
    return ddp, opt


def backward(ddp, groups, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g)
    mine = slice(groups.dp_rank, None, groups.dp_size)
    loss = nn.functional.mse_loss(ddp(x[mine].to(torch.bfloat16)), y[mine])
    loss.backward()
    finalize_model_grads([ddp], groups)
    return loss.item()


def train(ddp, opt, groups, steps: int, first_seed: int = 0, stride: int = 1) -> list[float]:
    losses = []
    for step in range(steps):
        opt.zero_grad()
        losses.append(backward(ddp, groups, first_seed + stride * step))
        assert opt.step().applied
    return losses


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    dtype = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return a.dtype == b.dtype and torch.equal(a.view(dtype), b.view(dtype))


def assert_same_states(opt_a, opt_b) -> None:
    for p_a, p_b in zip(opt_a.params, opt_b.params):
        a, b = opt_a.param_state(p_a), opt_b.param_state(p_b)
        assert all(same_bits(a[k], b[k]) for k in STATE_KEYS)


def assert_weights_are_high_halves(opt) -> None:
    """Every bf16 weight is the high half of its main value (on every dp rank)."""
    for p in opt.params:
        main = opt.param_state(p)["main"]
        assert same_bits(p.detach(), model_weight(main) if p.dtype == torch.bfloat16 else main)


def torch_adamw_step(ddp, state: dict, lr: float, wd: float) -> list[dict]:
    """The fp32-main path from `state` (a `state_dict`): torch.optim.AdamW (foreach, as on the
    CPU) over fp32 copies of the mains, with the moments of `state` and the gradients."""
    mains, groups = [], [{"params": []}, {"params": [], "weight_decay": 0.0}]
    adamw_state = {}
    for (name, p), s in zip(ddp.module.named_parameters(), state["params"]):
        main = s["main"].clone().requires_grad_()
        main.grad = p.main_grad.float().clone()
        groups[0 if uses_weight_decay(name, p) else 1]["params"].append(main)
        adamw_state[main] = {
            "step": torch.tensor(float(state["step"])),
            **{k: s[k].clone() for k in STATE_KEYS[1:]},
        }
        mains.append(main)
    adamw = torch.optim.AdamW(groups, lr=lr, weight_decay=wd, foreach=True)
    adamw.state.update(adamw_state)
    adamw.step()
    return [{"main": m.detach(), **{k: adamw.state[m][k] for k in STATE_KEYS[1:]}} for m in mains]


def fp32_copy_bytes(opt) -> int:
    """Bytes of fp32 main tensors the optimizer keeps beside the params."""
    return sum(
        4 * s.main.numel()
        for s in opt.shards
        if s.main is not None and s.main.data_ptr() != s.model_slice().data_ptr()
    )


def _one_process(rank, world):
    groups = ParallelGroups.build(Layout(dp=1), range(1))
    ddp, opt = wrap(groups, flag=True)
    ddp_ref, opt_ref = wrap(groups, flag=False)
    # the memory: 2 bytes of remainder per bf16 element, no fp32 copy
    bf16 = sum(p.numel() for p in opt.params if p.dtype == torch.bfloat16)
    assert all(s.main is None for s in opt.shards if s.param.dtype == torch.bfloat16)
    assert fp32_copy_bytes(opt) == 0 and fp32_copy_bytes(opt_ref) == 4 * bf16
    assert sum(2 * s.remainder.numel() for s in opt.shards if s.remainder is not None) == 2 * bf16
    for step in range(4):
        lr, wd = 1e-2 / (step + 1), 0.1 * step  # the schedule's hooks
        for o in (opt, opt_ref):
            o.set_lr(lr)
            o.set_weight_decay(wd)
        opt.zero_grad()
        backward(ddp, groups, seed=step)
        before = opt.state_dict()
        opt_ref.load_state_dict(before)  # the fp32 path from the same main value and moments
        for p, q in zip(ddp.parameters(), ddp_ref.parameters()):
            q.main_grad.copy_(p.main_grad)
        expected = torch_adamw_step(ddp, before, lr, wd)
        assert opt.step().applied and opt_ref.step().applied
        assert_same_states(opt, opt_ref)
        for p, want in zip(opt.params, expected):
            state = opt.param_state(p)
            assert all(same_bits(state[k], want[k]) for k in STATE_KEYS)
        assert_weights_are_high_halves(opt)
    assert fp32_copy_bytes(opt) == 0

    # a skipped step (overflow under a loss scale) and an interrupted one change nothing
    ddp, opt = wrap(groups, flag=True, loss_scale=4.0)
    train(ddp, opt, groups, steps=1)
    before = opt.state_dict()
    weights = [p.detach().clone() for p in opt.params]
    opt.zero_grad()
    backward(ddp, groups, seed=9)
    ddp.buffers[0].grad_data[3] = float("inf")
    assert not opt.step().applied
    opt.interrupted = True
    with pytest.raises(StepInterrupted):
        opt.step()
    assert all(same_bits(a, p.detach()) for a, p in zip(weights, opt.params))
    assert opt.step_count == 1
    assert all(
        same_bits(a[k], b[k])
        for a, b in zip(before["params"], opt.state_dict()["params"])
        for k in STATE_KEYS
    )

    # end to end, the losses of the two modes stay close
    ddp, opt = wrap(groups, flag=True)
    ddp_ref, opt_ref = wrap(groups, flag=False)
    losses = train(ddp, opt, groups, 8, stride=0)  # one batch: the loss goes down
    ref_losses = train(ddp_ref, opt_ref, groups, 8, stride=0)
    assert losses[-1] < losses[0]
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-2 * abs(b), (losses, ref_losses)


def test_a_step_is_torch_adamw_on_the_joined_main_without_fp32_copies():
    spawn(_one_process, world=1)


# --- dp 2 with ZeRO-1: state moves between the modes exactly ---------------------------------------
def _distributed(rank, world):
    groups = ParallelGroups.build(Layout(dp=2), range(2))
    ddp_a, opt_a = wrap(groups, flag=True, distopt=True)
    train(ddp_a, opt_a, groups, steps=3)
    assert fp32_copy_bytes(opt_a) == 0
    assert_weights_are_high_halves(opt_a)  # gathered from both owners
    state_a = opt_a.state_dict()
    for flag, distopt in ((False, True), (False, False), (True, False), (True, True)):
        ddp_b, opt_b = wrap(groups, flag=flag, distopt=distopt)
        opt_b.load_state_dict(state_a)
        state_b = opt_b.state_dict()
        assert state_b["step"] == 3
        for a, b in zip(state_a["params"], state_b["params"]):
            assert all(same_bits(a[k], b[k]) for k in STATE_KEYS)
        if flag:  # the same weights too: the high halves, not a cast
            assert all(same_bits(a, b) for a, b in zip(ddp_a.parameters(), ddp_b.parameters()))

    # the live reshard's path (shard_state / load_shard_state), into the other mode and back
    ddp_c, opt_c = wrap(groups, flag=False, distopt=True)
    adopt_tensors([ddp_c], opt_c, export_tensors([ddp_a], opt_a, opt_a.config))
    ddp_d, opt_d = wrap(groups, flag=True, distopt=True)
    adopt_tensors([ddp_d], opt_d, export_tensors([ddp_c], opt_c, opt_c.config))
    for opt in (opt_c, opt_d):
        opt.step_count = opt_a.step_count
        assert_same_states(opt, opt_a)
    assert all(same_bits(a, d) for a, d in zip(ddp_a.parameters(), ddp_d.parameters()))
    # ... and the copy trains on as the original
    assert train(ddp_a, opt_a, groups, 1, 20) == train(ddp_d, opt_d, groups, 1, 20)
    assert_same_states(opt_a, opt_d)
    assert all(same_bits(a, d) for a, d in zip(ddp_a.parameters(), ddp_d.parameters()))


def test_state_moves_between_modes_and_over_zero1_bit_exactly():
    spawn(_distributed, world=2)


def test_the_flag_needs_bf16():
    for extra in ({}, {"fp16": True}):
        with pytest.raises(ValueError, match="--use-precision-aware-optimizer needs --bf16"):
            OptimizerConfig(use_precision_aware_optimizer=True, **extra)
    with pytest.raises(ConfigError, match="--use-precision-aware-optimizer"):
        parse_args(tiny_args(train_iters=10) + ["--use-precision-aware-optimizer"], 1)
    cfg = parse_args(tiny_args(train_iters=10) + ["--bf16", "--use-precision-aware-optimizer"], 1)
    assert cfg.optimizer.use_precision_aware_optimizer
