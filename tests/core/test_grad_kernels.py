"""The Triton gradient add of grad_kernels.py against torch (CUDA only: skipped here)."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_add_into_gpu_bit_equal_to_torch():
    from megadyn.core.tensor_parallel.grad_kernels import add_into

    gen = torch.Generator("cuda").manual_seed(0)
    for shape in [(3,), (4097,), (1000, 4099), (8192, 2048)]:
        main = torch.randn(shape, device="cuda", generator=gen)
        g = torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16)
        ref = main.clone().add_(g)
        add_into(main, g)
        assert torch.equal(main, ref), shape
