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
    Written without a GPU at hand: not yet run."""
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
    for a, b in zip(ref[1], result[1]):  # bf16 weights: an fp32 main value's last bits may
        torch.testing.assert_close(b, a, rtol=2**-7, atol=1e-6)  # round them one ulp apart
    saved = held1 - held2
    assert abs(saved - numel * 4 // 2) < 2**20, (held1, held2, numel)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_zero2_on_gpus():
    spawn(_gpus, world=2, timeout_s=300)
