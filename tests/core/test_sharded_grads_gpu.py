"""--data-parallel-sharding-strategy optim_grads on two GPUs (tests/core/test_sharded_grads.py
has the CPU tests and the tolerances' argument)."""

import gc

import pytest
import torch

from megadyn.launch import determinism
from megadyn.testing import spawn
from tests.core.test_sharded_grads import _run, _trainer

GPU_MODEL = ["--hidden-size", "256", "--num-attention-heads", "8", "--bf16"]


def _held(world, strategy, device):
    """Train; the losses and weights, the trainer, and the CUDA memory it holds after."""
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    trainer = _trainer(world, strategy, *GPU_MODEL, device=device)
    result = _run(trainer)
    torch.cuda.synchronize()
    return result, trainer, torch.cuda.memory_allocated() - base


def _gpus(rank, world):
    """Two GPUs (NCCL, the fused fp32 weight-gradient GEMMs writing into the staging):
    ZeRO-2 trains like ZeRO-1, and between steps holds (1 - 1/dp) x 4 bytes a gradient element
    less, to within 1 MiB. Deterministic mode, as tests/core/test_distopt_instances.py says.
    The bf16 weights after 3 Adam steps: see below."""
    determinism.enable()
    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    _held(world, "optim", device)  # warm-up: kernels, cuBLAS workspaces, kept constants
    ref, zero1, held1 = _held(world, "optim", device)
    numel = sum(b.numel for d in zero1.ddp for b in d.buffers)
    del zero1
    result, zero2, held2 = _held(world, "optim_grads", device)
    for a, b in zip(ref[0], result[0]):  # losses
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (ref[0], result[0])
    # the gradient norms: the first step's, before any Adam step, a few ulps apart; the later
    # steps' also carry the weights' differences below
    assert abs(ref[2][0] - result[2][0]) <= 1e-5 * ref[2][0], (ref[2], result[2])
    for a, b in zip(ref[2], result[2]):
        assert abs(a - b) <= 1e-3 * abs(a), (ref[2], result[2])
    # Adam divides each element by its own magnitude: where a gradient element is near zero
    # its last bits (the summation order) can move the update by up to 2 lr a step (a sign
    # flip; lr 1e-3). Nearly every bf16 weight is within one ulp of ZeRO-1's.
    lr, off, total = 1e-3, 0, 0
    for a, b in zip(ref[1], result[1]):
        assert (a - b).abs().max().item() <= 2 * lr * len(ref[0])
        off += (~torch.isclose(b, a, rtol=2**-7, atol=1e-6)).sum().item()
        total += a.numel()
    assert off <= total // 100, (off, total)
    saved = held1 - held2
    assert abs(saved - numel * 4 // 2) < 2**20, (held1, held2, numel)


def _graphs(rank, world):
    """ZeRO-2 under CUDA graphs (one eager warm-up step, the second captured, the third a
    replay) trains as ZeRO-2 without them: the per-micro-batch reduce-scatters and adds into
    the shard are captured with each backward and replayed."""
    determinism.enable()
    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    eager = _run(_trainer(world, "optim_grads", *GPU_MODEL, device=device))
    graph = ["--enable-cuda-graph", "--cuda-graph-warmup-steps", "1"]
    trainer = _trainer(world, "optim_grads", *GPU_MODEL, *graph, device=device)
    graphed = _run(trainer)
    assert trainer.parts.cuda_graph is not None and trainer.parts.cuda_graph.captures == 1
    for a, b in zip(eager[0], graphed[0]):  # losses
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (eager[0], graphed[0])
    assert abs(eager[2][0] - graphed[2][0]) <= 1e-5 * eager[2][0], (eager[2], graphed[2])
    for a, b in zip(eager[1], graphed[1]):
        off = (~torch.isclose(b, a, rtol=2**-7, atol=1e-6)).sum().item()
        assert off <= a.numel() // 100, (off, a.numel())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_zero2_on_gpus():
    spawn(_gpus, world=2, timeout_s=300)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_zero2_under_cuda_graphs():
    spawn(_graphs, world=2, timeout_s=300)
