"""Fused paths equal the plain ones: weight-gradient accumulation into main_grad, and the
vocab-parallel cross entropy against torch's (the fused Triton kernels: tests/core/test_cross_entropy_kernels.py)."""

import torch
import torch.nn.functional as F

from megadyn.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megadyn.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy


def test_weight_grad_accumulates_into_main_grad():
    torch.manual_seed(0)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        fused = cls(16, 24, None, dtype=torch.bfloat16)
        plain = cls(16, 24, None, dtype=torch.bfloat16, grad_accumulation_fusion=False)
        for p in fused.parameters():
            torch.nn.init.normal_(p)
        plain.load_state_dict(fused.state_dict())
        fused.weight.main_grad = torch.zeros(fused.weight.shape)  # as DDP sets it (fp32)
        x = torch.randn(5, 3, 16, dtype=torch.bfloat16, requires_grad=True)
        x_plain = x.detach().clone().requires_grad_()
        fused(x).float().sum().backward()
        plain(x_plain).float().sum().backward()
        assert fused.weight.grad_added_to_main_grad
        torch.testing.assert_close(fused.weight.main_grad, plain.weight.grad.float())
        torch.testing.assert_close(x.grad, x_plain.grad)
        if fused.bias is not None:
            torch.testing.assert_close(fused.bias.grad, plain.bias.grad)


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
