"""AdamW on main params kept as bf16 weight + int16 remainder (megadyn/core/optimizer/
adam_kernels.py): the encoding is exact, the Triton kernel (Triton's interpreter on CPU tensors,
in a spawned process so that the switch precedes triton's import) gives the torch reference's
bits, and the reference follows torch's AdamW on an fp32 main copy to the last bits."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megadyn.core.optimizer.adam_kernels import adamw_remainders_, reference_
from megadyn.core.optimizer.remainders import join, split
from megadyn.testing import spawn

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def special_values() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    tiny = torch.finfo(torch.float32).tiny
    values = [0.0, -0.0, 1.0, -1.0, tiny, -tiny, tiny / 8, -tiny / 8, 3.0e38, -3.0e38]
    bits = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x00008000], dtype=torch.int64)
    ties = bits.to(torch.int32).view(torch.float32)  # exactly half-way between two bf16
    return torch.cat([torch.tensor(values), ties, torch.randn(4096, generator=gen) * 1e-3,
                      torch.randn(4096, generator=gen) * 50.0])  # fmt: skip


def test_split_join_is_exact_and_the_weight_is_the_nearest_bf16():
    value = special_values()
    weight, remainder = split(value)
    assert weight.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert torch.equal(join(weight, remainder).view(torch.int32), value.view(torch.int32))
    nearest = value.to(torch.bfloat16)
    differ = weight.view(torch.int16) != nearest.view(torch.int16)
    low = value.view(torch.int32) & 0xFFFF
    assert bool((low[differ] == 0x8000).all())  # only exact ties round otherwise
    assert int(differ.sum()) >= 1  # ... and the ties above do: away from zero
    assert torch.equal((weight.float() - value).abs() <= (nearest.float() - value).abs(),
                       torch.ones_like(differ))  # fmt: skip


def states(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    main = torch.randn(n, generator=gen) * 0.02
    weight, remainder = split(main)
    grads = [torch.randn(n, generator=gen) * 1e-2 for _ in range(4)]
    return main, weight, remainder, grads


def test_reference_follows_torch_adamw_on_an_fp32_main_copy():
    """Four steps: the joined main value against torch's AdamW (foreach) on fp32 mains. Both
    are fp32 op by op, torch's moment update a lerp and its square root not IEEE-rounded on the
    CPU, so they agree to a few units in the last place of the values (about 0.02 here)."""
    main, weight, remainder, grads = states(10_000, 1)
    param = torch.nn.Parameter(main.clone())
    adam = torch.optim.AdamW([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                             eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], foreach=True)  # fmt: skip
    m, v = torch.zeros_like(main), torch.zeros_like(main)
    for step, grad in enumerate(grads, start=1):
        param.grad = grad.clone()
        adam.step()
        reference_(weight, remainder, grad, m, v, step=step, **HYPER)
        ours = join(weight, remainder)
        assert (ours - param.detach()).abs().max() <= 2e-8  # 4 ulp at 0.06
        assert (m - adam.state[param]["exp_avg"]).abs().max() <= 2e-9
        assert (v - adam.state[param]["exp_avg_sq"]).abs().max() <= 4e-11
    assert not torch.equal(join(weight, remainder), main)  # it moved


def test_the_clip_taken_in_the_update_equals_the_gradients_scaled_first():
    """grad_scale gives the bits of the gradients scaled in place before the update (what
    clip_grads did as a pass of its own), and 1.0 those of the unscaled update."""
    main, weight, remainder, grads = states(5_000, 3)
    scaled = [(weight.clone(), remainder.clone(), torch.zeros_like(main), torch.zeros_like(main))
              for _ in range(2)]  # fmt: skip
    for step, grad in enumerate(grads, start=1):
        first = grad.clone()
        torch._foreach_mul_([first], 0.3)
        reference_(*scaled[0][:2], first, *scaled[0][2:], step=step, **HYPER)
        reference_(*scaled[1][:2], grad, *scaled[1][2:], step=step, grad_scale=0.3, **HYPER)
    for a, b in zip(*scaled):
        assert torch.equal(a, b)
    plain = (weight.clone(), remainder.clone(), torch.zeros_like(main), torch.zeros_like(main))
    ones = (weight.clone(), remainder.clone(), torch.zeros_like(main), torch.zeros_like(main))
    for step, grad in enumerate(grads, start=1):
        reference_(*plain[:2], grad, *plain[2:], step=step, **HYPER)
        reference_(*ones[:2], grad, *ones[2:], step=step, grad_scale=1.0, **HYPER)
    assert all(torch.equal(a, b) for a, b in zip(plain, ones))
    assert not torch.equal(plain[0], scaled[0][0])  # the clip changed the update


def kernel_body(rank, world):
    from megadyn.core.optimizer import adam_kernels

    n = 3 * adam_kernels.BLOCK + 17  # the last program is cut short
    main, weight, remainder, grads = states(n, 2)
    ref = (weight.clone(), remainder.clone(), torch.zeros(n), torch.zeros(n))
    got = (weight.clone(), remainder.clone(), torch.zeros(n), torch.zeros(n))
    for step, grad in enumerate(grads, start=1):
        scale = 0.37 if step == 2 else 1.0  # a clipped step
        reference_(ref[0], ref[1], grad, ref[2], ref[3], step=step, grad_scale=scale, **HYPER)
        adam_kernels._launch(got[0], got[1], grad, got[2], got[3], step=step, grad_scale=scale,
                             **HYPER)  # fmt: skip
        for a, b in zip(ref, got):
            assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernel_gives_the_reference_bits(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spawn(kernel_body, world=1)


def test_refuses_tensors_of_other_lengths():
    weight, remainder = split(torch.zeros(8))
    with pytest.raises(ValueError, match="one length"):
        adamw_remainders_(weight, remainder, torch.zeros(7), torch.zeros(8), torch.zeros(8),
                          step=1, **HYPER)  # fmt: skip


def one_pass_body(rank, world):
    """The optimizer's CUDA branch (forced on CPU tensors, where adamw_remainders_ runs its
    reference): each remainder shard takes the one-pass update at the optimizer's step count
    and clip, the fp32 param takes torch's fused update, and the step counters advance."""
    from megadyn.core.groups import ParallelGroups
    from megadyn.core.layout import Layout
    from megadyn.core.optimizer.clip_grads import clip_coefficient
    from megadyn.core.optimizer.shards import STATE_KEYS
    from tests.core.test_precision_aware_optimizer import backward, wrap

    groups = ParallelGroups.build(Layout(dp=1), range(1))
    ddp, opt = wrap(groups, flag=True, clip_grad=0.05)
    opt._fused = True
    for step in range(1, 4):
        opt.zero_grad()
        backward(ddp, groups, seed=step)
        before = [{k: v.clone() for k, v in opt.param_state(p).items()} for p in opt.params]
        result = opt.step()
        assert result.applied
        clip = clip_coefficient(opt.config.clip_grad, result.grad_norm)
        assert clip < 1.0  # the update takes the clip (the gradients stay as reduced)
        for p, state in zip(opt.params, before):
            after = opt.param_state(p)
            if p.dtype != torch.bfloat16:
                assert not torch.equal(after["main"], state["main"])
                continue
            weight, remainder = split(state["main"].reshape(-1))
            m, v = state["exp_avg"].reshape(-1), state["exp_avg_sq"].reshape(-1)
            grad = p.main_grad.float().reshape(-1)
            decay = 0.1 if p.dim() > 1 else 0.0
            reference_(weight, remainder, grad, m, v, step=step, lr=1e-2, beta1=0.9,
                       beta2=0.999, eps=1e-8, weight_decay=decay, grad_scale=clip)  # fmt: skip
            want = {"main": join(weight, remainder), "exp_avg": m, "exp_avg_sq": v}
            for key in STATE_KEYS:
                assert torch.equal(after[key].reshape(-1), want[key]), (step, key)
        assert all(int(s.adam["step"]) == step for s in opt.shards)


def test_optimizer_one_pass_branch():
    spawn(one_pass_body, world=1)
