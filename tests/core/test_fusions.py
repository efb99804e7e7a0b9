"""Fused paths equal the plain ones: weight-gradient accumulation into main_grad, and the
vocab-parallel cross entropy against torch's (the fused Triton kernels: tests/core/test_cross_entropy_kernels.py)."""

import pytest
import torch
import torch.nn.functional as F

from megadyn.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megadyn.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_weight_grad_accumulates_into_main_grad(device):
    """Weight and bias gradients go into the fp32 main_grad (twice: they accumulate); the
    bias's is summed in fp32 on CUDA (grad_kernels.py), so it matches the bf16 sum there
    only to bf16 rounding."""
    torch.manual_seed(0)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        kw = dict(dtype=torch.bfloat16, device=device)
        fused = cls(16, 24, None, **kw)
        plain = cls(16, 24, None, grad_accumulation_fusion=False, **kw)
        for p in fused.parameters():
            torch.nn.init.normal_(p)
        plain.load_state_dict(fused.state_dict())
        for p in fused.parameters():  # as DDP sets it (fp32)
            p.main_grad = torch.zeros(p.shape, device=device)
        x = torch.randn(5, 3, 16, dtype=torch.bfloat16, requires_grad=True, device=device)
        x_plain = x.detach().clone().requires_grad_()
        for _ in range(2):
            fused(x).float().sum().backward()
            plain(x_plain).float().sum().backward()
            for p in fused.parameters():
                assert p.grad_added_to_main_grad
                p.grad, p.grad_added_to_main_grad = None, False  # the DDP hook's part
        # CUDA sums in fp32 what the plain path rounds to bf16 (twice: it accumulates in bf16)
        tol = {} if device == "cpu" else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(fused.weight.main_grad, plain.weight.grad.float(), **tol)
        torch.testing.assert_close(x.grad, x_plain.grad)
        if fused.bias is not None:
            torch.testing.assert_close(fused.bias.main_grad, plain.bias.grad.float(), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_grad_accumulates_rows_into_main_grad(device):
    """An untied table's gradient goes into its fp32 main_grad row by row, repeated ids summed
    and two micro batches accumulated: the fp32 sum of the output gradient's rows, to the bit
    (small integers, so every order of the sums gives the same bits)."""
    rows, h = 11, 8
    emb = VocabParallelEmbedding(
        rows, rows, h, None, grad_accumulation_fusion=True, dtype=torch.bfloat16, device=device
    )
    torch.nn.init.normal_(emb.weight)
    emb.weight.main_grad = torch.zeros(rows, h, device=device)
    gen = torch.Generator().manual_seed(0)
    want = torch.zeros(rows, h, dtype=torch.float64)
    for _ in range(2):
        ids = torch.randint(0, 4, (3, 5), generator=gen)  # [b, s], ids repeated
        g = torch.randint(-8, 9, (5, 3, h), generator=gen).to(torch.bfloat16)  # [s, b, h]
        y = emb(ids.to(device))
        torch.testing.assert_close(y, emb.weight[ids.t().to(device)], rtol=0, atol=0)
        y.backward(g.to(device))
        assert emb.weight.grad_added_to_main_grad
        emb.weight.grad, emb.weight.grad_added_to_main_grad = None, False  # the DDP hook's part
        want.index_add_(0, ids.t().reshape(-1), g.reshape(-1, h).double())
    torch.testing.assert_close(emb.weight.main_grad.cpu(), want.float(), rtol=0, atol=0)


def test_cross_entropy_matches_torch():
    torch.manual_seed(0)
    logits = (3 * torch.randn(8, 2, 50)).requires_grad_()
    target = torch.randint(0, 50, (8, 2))
    loss = vocab_parallel_cross_entropy(logits, target, 0, None)
    ref = F.cross_entropy(logits.reshape(-1, 50), target.reshape(-1), reduction="none")
    torch.testing.assert_close(loss, ref.reshape(8, 2))
    w = torch.randn(8, 2)
    grad = torch.autograd.grad((loss * w).sum(), logits)[0]
    grad_ref = torch.autograd.grad((ref.reshape(8, 2) * w).sum(), logits)[0]
    torch.testing.assert_close(grad, grad_ref)


def test_kept_rows_of_ones_are_never_replaced():
    """A CUDA graph may hold the row of ones a bias gradient read: a longer row is added beside
    it, and the first stays kept (its memory is not handed back)."""
    from megadyn.core.tensor_parallel import wgrad

    device = torch.device("cpu")
    first = wgrad._ones(6, torch.float16, device)
    longer = wgrad._ones(9, torch.float16, device)
    kept = wgrad._ONES[(torch.float16, device)]
    assert any(t.data_ptr() == first.data_ptr() for t in kept)
    assert first.shape == (1, 6) and longer.shape == (1, 9)
    assert bool(first.eq(1).all()) and bool(longer.eq(1).all())
    assert wgrad._ones(4, torch.float16, device).data_ptr() == longer.data_ptr()
