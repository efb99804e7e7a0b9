"""Helpers of the Triton kernel tests (test_bias_gelu.py, test_add_norm.py).

    interpreted(monkeypatch, body, world=2, args=(...))  # body's ranks run kernels on CPU tensors
    uninterpreted(monkeypatch, body)                     # ... where triton compiles for real
    compiled(monkeypatch, body)                          # body compiles kernels for sm_90
    grads = gradients(model, x, w)                       # out, x.grad, every param's gradient
    assert_close_scaled(fused, plain, tol)               # dicts of tensors, each on its own scale

Triton's interpreter must be switched on (TRITON_INTERPRET=1) before triton is imported, so
every body runs in spawned processes that inherit the environment set here.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megadyn.testing import spawn


def interpreted(monkeypatch, body, world: int = 1, args=()) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spawn(body, world=world, args=args)


def uninterpreted(monkeypatch, body) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spawn(body, world=1)


def compiled(monkeypatch, body) -> None:
    """Run `body`, which compiles kernels (megadyn.testing.triton_compile), where it can."""
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton without its NVIDIA backend")
    uninterpreted(monkeypatch, body)


def gradients(model, x: torch.Tensor, w: torch.Tensor) -> dict:
    """model(x) and, after backward of sum(out * w), the gradients of x and of every parameter
    (`main_grad` where DDP gave one), by name."""
    x = x.clone().requires_grad_()
    out = model(x)
    (out.float() * w).sum().backward()
    grads = {"out": out.detach(), "x": x.grad}
    inner = getattr(model, "module", model)  # under DDP, the wrapped module
    for name, p in inner.named_parameters():
        grads[name] = p.main_grad if hasattr(p, "main_grad") else p.grad
    return grads


def assert_close_scaled(fused: dict, plain: dict, tol: dict) -> None:
    """Each tensor of `fused` close to the same-named one of `plain`, both divided by the
    largest magnitude of the plain one (bf16 paths that round at other places)."""
    assert fused.keys() == plain.keys()
    for name in fused:
        scale = plain[name].float().abs().max()
        torch.testing.assert_close(
            fused[name].float() / scale,
            plain[name].float() / scale,
            **tol,
            msg=lambda m, name=name: f"{name}: {m}",
        )
