"""The ring's fused block kernels (megadyn/core/context_parallel/kernels.py) equal the math path
of blocks.py: forward (output and log-sum-exp) and backward, causal and not, with grouped
queries; blocks computed apart, merged by their log-sum-exp and differentiated with the final
output, give the whole attention and its gradients; the ring with them equals the math ring.
On CPU torch's CPU flash kernels run in fp32 (within 1e-5); on a GPU the CUDA flash and cuDNN
kernels in bf16 against torch's whole attention in fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megadyn.core.context_parallel.blocks import block_backward, block_forward, merge_into
from megadyn.core.context_parallel.dropout import block_dropout, call_seed
from megadyn.core.context_parallel.kernels import (
    block_kernels,
    cudnn_block_backward,
    cudnn_block_forward,
    fused_block_backward,
    fused_block_forward,
    is_hopper,
    kernel_for_backend,
)
from megadyn.testing.spawn import spawn

B, N, G, D = 2, 4, 2, 8  # batch, query heads, key/value heads, head size


def qkv(sq: int, sk: int, dtype=torch.float32, device="cpu", seed: int = 0, d: int = D):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, N, sq, d), (B, G, sk, d), (B, G, sk, d)]
    return [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("sq,sk,causal", [(12, 12, True), (12, 12, False), (6, 12, False)])
def test_fused_block_equals_math_block(sq, sk, causal):
    q, k, v = qkv(sq, sk)
    scale = D**-0.5
    out, lse = fused_block_forward(q, k, v, causal, scale)
    ref_out, ref_lse = block_forward(q, k, v, causal, scale)
    assert max_rel(out, ref_out) < 1e-5 and max_rel(lse, ref_lse) < 1e-5
    dout = torch.randn_like(out)
    grads = fused_block_backward(dout, q, k, v, out, lse, causal, scale)
    ref = block_backward(dout, q, k, v, ref_out, ref_lse, causal, scale)
    for got, want in zip(grads, ref, strict=True):
        assert got.shape == want.shape and max_rel(got, want) < 1e-5


def blockwise_attention(q, k, v, forward, backward, dout, scale, dropout=None):
    """Causal attention over two key blocks as the ring computes it: the diagonal block causal,
    the earlier block unmasked; merged by log-sum-exp, each block's backward given the final
    output and log-sum-exp; each block given its part of `dropout` [b, n, s, s] (the dropout
    scale of every query/key pair) when one is. Returns the output and (dq, dk, dv)."""
    extra = (
        (lambda rows, cols: ()) if dropout is None else (lambda r, c: (None, dropout[..., r, c]))
    )
    half = k.shape[2] // 2  # the second block's queries see all of the first block's keys
    blocks = [  # (query rows, key columns, causal)
        (slice(0, half), slice(0, half), True),
        (slice(half, None), slice(half, None), True),
        (slice(half, None), slice(0, half), False),
    ]
    out = torch.zeros_like(q, dtype=torch.float64)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float64, device=q.device)
    for rows, cols, causal in blocks:
        o, s = forward(
            q[:, :, rows], k[:, :, cols], v[:, :, cols], causal, scale, *extra(rows, cols)
        )
        merge_into(out[:, :, rows], lse[:, :, rows], o.double(), s.double())
    out, lse = out.to(q.dtype), lse.float()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, cols, causal in blocks:
        g = backward(
            dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
            out[:, :, rows], lse[:, :, rows], causal, scale, *extra(rows, cols),
        )  # fmt: skip
        dq[:, :, rows] += g[0].to(q.dtype)
        dk[:, :, cols] += g[1].to(k.dtype)
        dv[:, :, cols] += g[2].to(v.dtype)
    return out, (dq, dk, dv)


def whole_attention(q, k, v, dout):
    """torch's causal attention over all keys, with autograd's gradients (fp32)."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(dout.float())
    return out.detach(), (q.grad, k.grad, v.grad)


def test_fused_blocks_merge_into_the_whole_attention():
    q, k, v = qkv(16, 16, seed=1)
    dout = torch.randn(B, N, 16, D, generator=torch.Generator().manual_seed(2))
    forward, backward = block_kernels(q, "flash")
    out, grads = blockwise_attention(q, k, v, forward, backward, dout, D**-0.5)
    ref_out, ref_grads = whole_attention(q, k, v, dout)
    assert max_rel(out, ref_out) < 1e-5
    for got, want in zip(grads, ref_grads, strict=True):
        assert max_rel(got, want) < 1e-5


def test_math_blocks_with_dropout_merge_into_the_dropped_attention():
    """Attention dropout scales each block's probabilities while the log-sum-exp stays the
    undropped one: the merged blocks and their gradients equal autograd's through softmax,
    the same mask and the values (fp64, within 1e-6: the helper keeps the log-sum-exp in
    fp32); the fused kernels refuse a mask."""
    q, k, v = (t.double() for t in qkv(16, 16, seed=3))
    dout = torch.randn(B, N, 16, D, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    drop = block_dropout(5, 0.3, 1, 2, (B, N, 16, 16), "cpu").double()  # [b, n, sq, sk]
    assert drop.eq(0).any() and drop.ne(0).any()
    out, grads = blockwise_attention(q, k, v, block_forward, block_backward, dout, D**-0.5, drop)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    scores = q @ k.repeat_interleave(N // G, 1).transpose(-1, -2) * D**-0.5
    scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    ref = (scores.softmax(-1) * drop) @ v.repeat_interleave(N // G, 1)
    ref.backward(dout)
    assert max_rel(out, ref.detach()) < 1e-10
    for got, want in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        assert max_rel(got, want) < 1e-6
    with pytest.raises(ValueError, match="dropout"):
        fused_block_forward(q, k, v, True, D**-0.5, None, drop)
    assert block_dropout(5, 0.3, 1, 2, (1, 1, 4, 4), "cpu").equal(
        block_dropout(5, 0.3, 1, 2, (1, 1, 4, 4), "cpu")
    )  # drawn again for the backward: the same mask


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
        ),
    ],
)
def test_call_seeds_follow_the_stream(device):
    """A call's dropout seed is a function of the stream's state, which it moves on: the same
    state gives the same seeds (recomputation, resume, every cp rank), successive calls differ;
    on CPU it is the draw it always was."""
    seed_stream = torch.cuda.manual_seed if device == "cuda" else torch.manual_seed
    get, put = (
        (torch.cuda.get_rng_state, torch.cuda.set_rng_state)
        if device == "cuda"
        else (torch.get_rng_state, torch.set_rng_state)
    )
    saved = get()
    seed_stream(7)
    start = get()
    seeds = [call_seed(torch.device(device)) for _ in range(3)]
    put(start)
    assert [call_seed(torch.device(device)) for _ in range(3)] == seeds
    assert len(set(seeds)) == 3 and all(0 <= x < 2**63 for x in seeds)
    if device == "cpu":
        put(start)
        assert seeds[0] == int(torch.randint(0, 2**63 - 1, (1,)).item())
    put(saved)


def test_kernel_names_and_backends():
    q = torch.zeros(1, 1, 4, 8)
    assert block_kernels(q) == (block_forward, block_backward)  # CPU and fp32: the math path
    assert block_kernels(q, "flash") == (fused_block_forward, fused_block_backward)
    assert [kernel_for_backend(b) for b in ("auto", "flash", "fused", "unfused")] == [
        None, "flash", "cudnn", "math",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="--attention-backend fused"):
        block_kernels(q, "cudnn")
    assert block_kernels(q, "flash", masked=True) == (block_forward, block_backward)  # documents
    with pytest.raises(ValueError, match="no document mask"):
        fused_block_forward(q, q, q, True, 1.0, torch.ones(1, 1, 4, 4, dtype=torch.bool))


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_cuda_kernel_calls_check_on_meta_tensors(kernel):
    """The CUDA kernels' argument lists and shapes, through torch's meta kernels (no GPU)."""
    forward, backward = {"flash": (fused_block_forward, fused_block_backward)}.get(
        kernel, (cudnn_block_forward, cudnn_block_backward)
    )
    q, k, v = (t.to("meta", torch.bfloat16) for t in qkv(12, 16))
    out, lse = forward(q, k, v, False, 0.5)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    grads = backward(torch.empty_like(out), q, k, v, out, lse, False, 0.5)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kernel", [None, "cudnn"])
def test_cuda_blocks_equal_the_whole_attention_on_gpu(kernel):
    """bf16 default blocks (cuDNN on Hopper, flash elsewhere) and cuDNN blocks against torch's
    whole attention in fp32 on the GPU, at the ring's head size."""
    d, s = 128, 256
    q, k, v = qkv(s, s, torch.bfloat16, "cuda", seed=3, d=d)
    forward, backward = block_kernels(q, kernel)
    default = cudnn_block_forward if is_hopper(q.device.index or 0) else fused_block_forward
    assert kernel or forward is default
    dout = torch.randn(B, N, s, d, device="cuda", dtype=torch.bfloat16)
    out, grads = blockwise_attention(q, k, v, forward, backward, dout, d**-0.5)
    ref_out, ref_grads = whole_attention(q, k, v, dout)
    errors = [max_rel(out, ref_out)] + [max_rel(a, b) for a, b in zip(grads, ref_grads)]
    print(f"{kernel or 'default'} blocks vs whole attention, bf16 (out, dq, dk, dv):", errors)
    assert max(errors) < 2e-2


def ring_body(rank: int, world: int) -> list[float]:
    """The ring over `world` gloo ranks with the fused CPU kernels and with the math path,
    without and with document masks (the fused kernel once per document, documents.py):
    largest relative difference of the outputs and of the gradients of q, k and v."""
    import torch.distributed as dist

    from megadyn.core.context_parallel import ring_attention, split_sequence

    s = 8 * world
    q, k, v = (split_sequence(t, rank, world, dim=2) for t in qkv(s, s, seed=4))
    dout = torch.randn_like(q)
    # documents of 3, 6, 1 and 6 tokens in one row, one document spanning every chunk in the other
    docs = torch.tensor([[0] * 3 + [1] * 6 + [2] + [3] * (s - 10), [5] * 2 + [6] * (s - 2)])
    errors = []
    for document_ids in (None, docs[:B]):
        results = []
        for kernel in ("flash", "math"):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = ring_attention(
                *leaves, group=dist.group.WORLD, document_ids=document_ids, kernel=kernel
            )
            out.backward(dout)
            results.append([out.detach()] + [t.grad for t in leaves])
        errors.append(max(max_rel(a, b) for a, b in zip(*results, strict=True)))
    return errors


def test_ring_with_fused_blocks_equals_the_math_ring():
    for errors in spawn(ring_body, world=2):
        assert max(errors) < 1e-5, errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_document_blocks_through_the_default_kernel_on_gpu():
    """A causal block of packed documents through the default fused kernel once per document
    (documents.py), bf16, against the math block under the document mask in fp32."""
    from megadyn.core.context_parallel.documents import (
        document_rects,
        documents_backward,
        documents_forward,
    )

    d, s = 128, 512
    q, k, v = qkv(s, s, torch.bfloat16, "cuda", seed=6, d=d)
    lengths = [[100, 300, 112], [512]]
    doc = torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in lengths])
    doc = doc.to("cuda")
    forward, backward = block_kernels(q)
    rects = document_rects(doc, doc, causal=True)
    assert len(rects) == 4
    out, lse = documents_forward(forward, q, k, v, d**-0.5, rects)
    dout = torch.randn_like(q)
    grads = documents_backward(backward, dout, q, k, v, out, lse, d**-0.5, rects)
    visible = (doc.unsqueeze(-1) == doc.unsqueeze(-2)).unsqueeze(1)
    q32, k32, v32, dout32 = (t.float() for t in (q, k, v, dout))
    ref_out, ref_lse = block_forward(q32, k32, v32, True, d**-0.5, visible)
    ref = block_backward(dout32, q32, k32, v32, ref_out, ref_lse, True, d**-0.5, visible)
    errors = [max_rel(out, ref_out)] + [max_rel(a, b) for a, b in zip(grads, ref)]
    print("document blocks vs the masked math block, bf16 (out, dq, dk, dv):", errors)
    assert max(errors) < 2e-2
