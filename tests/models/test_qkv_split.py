"""split_qkv inside a CUDA graph (its backward one tensor, each slice copied by Triton) gives
torch.split's gradient bit for bit, for gradients in the attention kernel's permuted layout
(GPU only: elsewhere split_qkv is torch.split)."""

import pytest
import torch

from megadyn.models.qkv_split import split_qkv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("q_per_group,d", [(1, 16), (4, 24), (2, 128)])
def test_split_qkv_gradient_in_cuda_graph_gpu(q_per_group, d):
    s, b, g, sizes = 9, 2, 3, [q_per_group, 1, 1]
    gen = torch.Generator("cuda").manual_seed(q_per_group)
    qkv = torch.randn(s, b, g, q_per_group + 2, d, device="cuda", generator=gen)
    qkv = qkv.to(torch.bfloat16).requires_grad_()

    def attention_layout_grad(n):  # [b, n, s, d] contiguous, seen as [s, b, g, n / g, d]
        t = torch.randn(b, n, s, d, device="cuda", generator=gen).to(torch.bfloat16)
        return t.permute(2, 0, 1, 3).reshape(s, b, g, n // g, d)

    grads = [attention_layout_grad(n) for n in (g * q_per_group, g, g)]
    want = torch.autograd.grad(torch.split(qkv, sizes, dim=3), qkv, grads)[0]
    want_qk = torch.autograd.grad(torch.split(qkv, sizes, dim=3)[:2], qkv, grads[:2])[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, not captured: torch.split
        torch.autograd.grad(split_qkv(qkv, q_per_group), qkv, grads)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = split_qkv(qkv, q_per_group)
        assert "SplitQKV" in type(outs[0].grad_fn).__name__
        got = torch.autograd.grad(outs, qkv, grads)[0]
        got_qk = torch.autograd.grad(split_qkv(qkv, q_per_group)[:2], qkv, grads[:2])[0]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert torch.equal(got_qk, want_qk)  # v unused: its slice is zero
    assert not got_qk[:, :, :, -1].any()
