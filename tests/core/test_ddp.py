"""Data-parallel gradient buffers: parity with one process on the whole batch (gloo, CPU)."""

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megadyn.core.distributed import DistributedDataParallel
from megadyn.core.distributed.param_and_grad_buffer import plan_buckets
from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.testing.spawn import spawn


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # 104 + 26 + 70 = 200 elements: not a multiple of any dp size tested
    return nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.GELU(), nn.Linear(13, 5))


def make_batch(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 7, generator=g), torch.randn(n, 5, generator=g)


def reference_grads(x, y) -> dict[str, torch.Tensor]:
    model = make_model()
    nn.functional.mse_loss(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def owned_elements(ddp: DistributedDataParallel):
    """(name, owned slice of the flat param range, main_grad flat) for this dp rank."""
    names = {p: n for n, p in ddp.module.named_parameters()}
    for buffer in ddp.buffers:
        for bucket in buffer.buckets:
            lo, hi = bucket.shard_range()
            for p, (start, end) in bucket.param_ranges.items():
                s, e = max(start, lo), min(end, hi)
                if s < e:
                    yield names[p], slice(s - start, e - start), p.main_grad.view(-1)


def _overlap_parity(rank, world, bucket_size, use_distributed_optimizer, average_in_collective):
    groups = ParallelGroups.build(Layout(dp=world), range(world))
    x, y = make_batch(4 * world)
    ref = reference_grads(x, y)
    ddp = DistributedDataParallel(
        make_model(),
        groups.dp_group,
        overlap_grad_reduce=True,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
        average_in_collective=average_in_collective,
    )
    buckets = [b for buf in ddp.buffers for b in buf.buckets]
    assert len(buckets) > 1
    part = slice(rank * 4, (rank + 1) * 4)
    nn.functional.mse_loss(ddp(x[part]), y[part]).backward()
    # every bucket was launched from the hooks, during backward
    assert all(b._launched for b in buckets)
    assert all(p.grad is None for p in ddp.parameters())
    ddp.finish_grad_sync()
    checked = 0
    for name, owned, grad in owned_elements(ddp):
        torch.testing.assert_close(grad[owned], ref[name].view(-1)[owned], rtol=0, atol=1e-6)
        checked += owned.stop - owned.start
    return checked


@pytest.mark.parametrize(
    "use_distributed_optimizer,average_in_collective", [(False, False), (True, True)]
)
def test_overlapped_buckets_match_single_process(use_distributed_optimizer, average_in_collective):
    args = (60, use_distributed_optimizer, average_in_collective)
    checked = spawn(_overlap_parity, world=2, args=args)
    total = sum(p.numel() for p in make_model().parameters())
    assert sum(checked) == (total if use_distributed_optimizer else 2 * total)


def _accumulation(rank, world, overlap):
    groups = ParallelGroups.build(Layout(dp=world), range(world))
    micro, mbs = 3, 2
    x, y = make_batch(micro * mbs * world)
    ref = reference_grads(x, y)
    ddp = DistributedDataParallel(
        make_model(), groups.dp_group, overlap_grad_reduce=overlap, bucket_size=80
    )
    buckets = [b for buf in ddp.buffers for b in buf.buckets]
    calls = []
    real_all_reduce = dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: calls.append(t.numel()) or real_all_reduce(t, *a, **k)
    try:
        for _step in range(2):  # the second step checks that zero_grad_buffer resets everything
            ddp.zero_grad_buffer()
            calls.clear()
            for i in range(micro):
                lo = (i * world + rank) * mbs  # micro batch i, this rank's part
                ctx = ddp.no_sync() if i < micro - 1 else nullcontext()
                with ctx:
                    out = ddp(x[lo : lo + mbs])
                    (nn.functional.mse_loss(out, y[lo : lo + mbs]) / micro).backward()
                if i < micro - 1:
                    assert not calls and not any(b._launched for b in buckets)
            assert len(calls) == (len(buckets) if overlap else 0)
            ddp.finish_grad_sync()
            assert len(calls) == len(buckets) > 1
            for name, p in ddp.module.named_parameters():
                torch.testing.assert_close(p.main_grad, ref[name], rtol=0, atol=1e-6)
    finally:
        dist.all_reduce = real_all_reduce


@pytest.mark.parametrize("overlap", [True, False])
def test_gradient_accumulation_reduces_once(overlap):
    spawn(_accumulation, world=2, args=(overlap,))


def test_buffer_layout_is_reversed_and_padded_for_distributed_optimizer():
    spawn(_layout, world=1)


def _layout(rank, world):
    groups = ParallelGroups.build(Layout(), [0])
    model = make_model()
    params = list(model.parameters())
    ddp = DistributedDataParallel(
        model, groups.dp_group, use_distributed_optimizer=True, bucket_size=100
    )
    (buffer,) = ddp.buffers
    starts = [buffer.param_index[p][0] for p in params]
    assert starts == sorted(starts, reverse=True)  # reverse order of registration
    assert all(b.numel % 128 == 0 for b in buffer.buckets)
    for p in params:  # params live in the param buffer; main_grad in the grad buffer
        start, end, _ = buffer.param_index[p]
        assert p.data.data_ptr() == buffer.param_data[start:end].data_ptr()
        assert p.main_grad.data_ptr() == buffer.grad_data[start:end].data_ptr()
    torch.testing.assert_close(
        [p.detach() for p in params], [p.detach() for p in make_model().parameters()]
    )


def test_plan_buckets_is_a_pure_function_of_sizes():
    # registration order: sizes 10, 50, 30, 20; laid out reversed
    ranges, buckets = plan_buckets(
        [10, 50, 30, 20], dp_size=1, bucket_size=40, use_distributed_optimizer=False
    )
    assert ranges == [(100, 110, 2), (50, 100, 1), (20, 50, 0), (0, 20, 0)]
    assert buckets == [(0, 50), (50, 100), (100, 110)]
    # ZeRO-1 over 3 ranks: buckets padded to lcm(3, 128) = 384; a separate (tied) param alone
    ranges, buckets = plan_buckets(
        [10, 50, 30, 20],
        dp_size=3,
        bucket_size=None,
        use_distributed_optimizer=True,
        separate=[True, False, False, False],
    )
    assert buckets == [(0, 384), (384, 768)]
    assert ranges[0] == (384, 394, 1) and ranges[1] == (50, 100, 0)
