"""The GPU path of attention within documents (flex_attention under a block mask built from
document ids): bf16 output and gradients follow a dense-mask reference, and at 16k tokens its
forward and backward stay far below the memory of one sequence x sequence mask. Skipped
without CUDA."""

import pytest
import torch
import torch.nn.functional as F

from megadyn.models.document_attention import DocumentMask, dense_document_mask, document_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def packed_ids(b: int, s: int, docs: int, seed: int = 0) -> torch.Tensor:
    """[b, s] non-decreasing document ids, `docs` documents of random lengths per sample."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(b, s, generator=g) < docs / s
    starts[:, 0] = False
    return starts.long().cumsum(-1).cuda()


def qkv(b, s, heads=8, groups=2, d=64, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(b, heads, s, d), (b, groups, s, d), (b, groups, s, d)]
    return [
        torch.randn(x, generator=g, device="cuda", dtype=dtype).requires_grad_() for x in shapes
    ]


def test_flex_block_mask_matches_dense_reference_in_bf16():
    b, s = 2, 2048 + 64  # not a multiple of the 128-token tile
    ids = packed_ids(b, s, docs=12)
    q, k, v = qkv(b, s)
    mask = DocumentMask.build(ids)
    assert mask.block_mask is not None and mask.dense is None
    out = document_attention(q, k, v, mask)
    grad = torch.randn_like(out)
    out.backward(grad)
    got = [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(
        *ref_in, attn_mask=dense_document_mask(ids), enable_gqa=True
    )
    ref.backward(grad.float())
    expected = [ref, *(x.grad for x in ref_in)]
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, expected):
        err = ((a - e).norm() / e.norm()).item()
        assert err < 2e-2, f"{name}: relative error {err:.2e}"
    causal = F.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=True)
    assert (causal - ref).abs().max() > 0.1  # the documents change the result


def test_16k_tokens_without_a_sequence_squared_mask():
    b, s = 1, 16384
    ids = packed_ids(b, s, docs=8)
    q, k, v = qkv(b, s)
    document_attention(q, k, v, DocumentMask.build(ids)).sum().backward()  # compile, warm up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = document_attention(q, k, v, DocumentMask.build(ids))
    out.sum().backward()
    end.record()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    print(f"16k document attention: forward+backward {start.elapsed_time(end):.1f} ms, "
          f"peak extra memory {extra / 2**20:.1f} MiB (a bool [s, s] mask: {s * s / 2**20:.0f} MiB)")  # fmt: skip
    assert extra < s * s / 4, f"peak extra memory {extra / 2**20:.0f} MiB"
    for _ in range(2):  # for scale: plain causal attention (torch's fastest kernel), same shape
        start.record()
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
        end.record()
        torch.cuda.synchronize()
    print(f"16k causal attention (no documents): forward+backward {start.elapsed_time(end):.1f} ms")
