"""varlen.py: runs of a packed sequence's query rows over their documents' keys from the
start, in one call, equal the attention of those rows under the dense document mask (output
and the gradients of q, k and v summed at each key's position); on a GPU the flash call
equals the math per segment."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megadyn.core.context_parallel.varlen import VarlenPlan, varlen_backward, varlen_forward
from megadyn.models.document_attention import dense_document_mask

S, N, G, D = 48, 4, 2, 8
DOCS = [0] * 10 + [1] * 25 + [2] * 13
RUNS = [(3, 10), (12, 20), (20, 30), (40, 48)]
"""Query rows (start, end) of a rank: inside documents 0, 1, 1 and 2 (two runs of one)."""


def plan_of(runs, device="cpu") -> VarlenPlan:
    starts = {doc: DOCS.index(doc) for doc in set(DOCS)}
    q_len = [e - a for a, e in runs]
    k_from = [starts[DOCS[a]] for a, _ in runs]
    k_len = [e - f for (_, e), f in zip(runs, k_from)]
    keys = torch.cat([torch.arange(f, e) for (_, e), f in zip(runs, k_from)])
    return VarlenPlan.build(q_len, k_len, device), keys.to(device)


def packed_call(q, k, v, dout_rows, planned, kernel=None):
    """(output rows, dq rows, dk and dv at every position) through varlen.py, fp32."""
    plan, keys = planned
    rows = torch.cat([torch.arange(a, e) for a, e in RUNS]).to(q.device)
    qp, kp, vp = q[rows], k[keys], v[keys]
    scale = q.shape[-1] ** -0.5
    out, saved = varlen_forward(qp, kp, vp, plan, scale, kernel)
    dq, dk, dv = varlen_backward(dout_rows, qp, kp, vp, out, saved, plan, scale, kernel)
    dk_all = torch.zeros(k.shape, device=k.device).index_add_(0, keys, dk.float())
    dv_all = torch.zeros(v.shape, device=v.device).index_add_(0, keys, dv.float())
    return out.float(), dq.float(), dk_all, dv_all


def test_runs_over_their_documents_equal_the_dense_mask():
    torch.manual_seed(0)
    q, k, v = torch.randn(S, N, D), torch.randn(S, G, D), torch.randn(S, G, D)
    rows = torch.cat([torch.arange(a, e) for a, e in RUNS])
    dout = torch.randn(len(rows), N, D)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    heads_first = [t.transpose(0, 1).unsqueeze(0) for t in leaves]
    mask = dense_document_mask(torch.tensor([DOCS]))
    ref = F.scaled_dot_product_attention(*heads_first, attn_mask=mask, enable_gqa=True)
    ref = ref[0].transpose(0, 1)[rows]
    ref.backward(dout)
    got = packed_call(q, k, v, dout, plan_of(RUNS))
    for name, a, b in zip(
        ["out", "dq", "dk", "dv"], got, [ref, leaves[0].grad[rows], *[t.grad for t in leaves[1:]]]
    ):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-5, msg=name)


def test_a_segment_needs_as_many_keys_as_queries():
    with pytest.raises(ValueError, match="fewer keys than queries"):
        VarlenPlan.build([4], [3], "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_flash_call_equals_the_math_per_segment_on_gpu():
    """bf16 flash varlen (grouped queries, head size 128) against the math path in fp32."""
    torch.manual_seed(1)
    d, bf16 = 128, dict(device="cuda", dtype=torch.bfloat16)
    q, k, v = (
        torch.randn(S, N, d, **bf16),
        torch.randn(S, G, d, **bf16),
        torch.randn(S, G, d, **bf16),
    )
    dout = torch.randn(sum(e - a for a, e in RUNS), N, d, **bf16)
    plan = plan_of(RUNS, "cuda")
    flash = packed_call(q, k, v, dout, plan)
    math = packed_call(q.float(), k.float(), v.float(), dout.float(), plan, "math")
    errors = [((a - b).norm() / b.norm()).item() for a, b in zip(flash, math)]
    print("varlen flash vs math, bf16 (out, dq, dk, dv):", errors)
    assert max(errors) < 2e-2
