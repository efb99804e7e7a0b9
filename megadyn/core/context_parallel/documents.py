"""Document-masked blocks through the fused kernels: one kernel call per document.

    docs = packed(document_ids)                       # the ids on the device and on the host
    rects = document_rects(q_doc, k_doc, causal)      # host-side (from docs.host: no device read)
    out, lse = documents_forward(forward, q, k, v, scale, rects)
    dq, dk, dv = documents_backward(backward, dout, q, k, v, out_all, lse_all, scale, rects)

Under --reset-attention-mask a query sees only keys of its own document. In a packed sequence
the document ids never decrease along the positions, so within a block the queries of one
document form runs of consecutive rows and its keys runs of consecutive columns: the visible
part of the block is a set of rectangles (a run of queries x a run of keys of the same
document), each wholly visible, or causal where it sits on the diagonal of a causal block (the
same run of positions as queries and keys). Each rectangle is one call of a fused kernel
(kernels.py: flash or cuDNN, which take no mask), merged by log-sum-exp as the ring merges its
blocks; query rows in no rectangle get output 0 and log-sum-exp -inf. This replaces the math
path's [b, 1, sq, sk] mask and [b, n, sq, sk] scores, whose memory ended the ring at 32k.

`forward` and `backward` are a kernel pair of kernels.py (same arguments, no mask). The
output and the gradients are in the accumulation precision (fp32 for 16-bit inputs), as
blocks.py's; the backward takes the final output and log-sum-exp of the query rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from megadyn.core.context_parallel.blocks import merge_into

Rect = tuple[int, int, int, int, int, bool]
"""(batch row, query start, query end, key start, key end, causal)."""


@dataclass(frozen=True)
class PackedDocuments:
    """A micro batch's document ids [b, S] where the attention runs (`ids`) and on the host
    (`host`): the per-document calls take their ranges from the host copy, made at its first
    use and kept for the micro batch (models/document_attention.py builds one per micro
    batch), instead of reading the device at every block. What the attention derives from
    them (its blocks' rectangles) is the same in every layer: `derived` computes it once per
    micro batch."""

    ids: torch.Tensor
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def host(self) -> torch.Tensor:
        return self.ids.cpu()

    def derived(self, key, make):
        """`make()`, computed at the first call with `key` and kept for the micro batch."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]


def packed(document_ids) -> PackedDocuments | None:
    """`document_ids` as PackedDocuments (a tensor's host copy is made at its first use)."""
    if document_ids is None or isinstance(document_ids, PackedDocuments):
        return document_ids
    return PackedDocuments(document_ids)


def device_ids(document_ids) -> torch.Tensor | None:
    """The document ids where the attention runs (of a tensor or PackedDocuments)."""
    return document_ids.ids if isinstance(document_ids, PackedDocuments) else document_ids


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(document, start, end) of each run of equal ids."""
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            runs.append((ids[start], start, i))
            start = i
    return runs


def document_rects(q_doc: torch.Tensor, k_doc: torch.Tensor, causal: bool) -> list[Rect]:
    """The visible rectangles of a block whose query rows have document ids q_doc [b, sq] and
    key columns k_doc [b, sk]. With `causal` the block's queries and keys are the same
    positions (a diagonal block): a run's own rectangle is causal, earlier runs of its document
    are wholly visible and later ones not at all."""
    if causal and q_doc.shape != k_doc.shape:
        raise ValueError(f"a causal block is square: queries {q_doc.shape}, keys {k_doc.shape}")
    ids = torch.cat([q_doc, k_doc], dim=1).tolist()  # host ids: no read from the device
    sq = q_doc.shape[1]
    rects = []
    for b, row in enumerate(ids):
        q_runs, k_runs = _runs(row[:sq]), _runs(row[sq:])
        for doc, qs, qe in q_runs:
            for kdoc, ks, ke in k_runs:
                if kdoc != doc or (causal and ks > qs):
                    continue
                rects.append((b, qs, qe, ks, ke, causal and ks == qs))
    return rects


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def documents_forward(forward, q, k, v, scale: float, rects: list[Rect]):
    """Output [b, n, sq, d] and log-sum-exp [b, n, sq] of q over k, v within `rects`."""
    out = torch.zeros(q.shape, dtype=_acc_dtype(q), device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    for b, qs, qe, ks, ke, causal in rects:
        o, s = forward(q[b : b + 1, :, qs:qe], k[b : b + 1, :, ks:ke], v[b : b + 1, :, ks:ke],
                       causal, scale)  # fmt: skip
        merge_into(out[b : b + 1, :, qs:qe], lse[b : b + 1, :, qs:qe], o.to(out.dtype), s.float())
    return out, lse


def documents_backward(backward, dout, q, k, v, out, lse, scale: float, rects: list[Rect]):
    """Gradients of q, k, v (accumulation precision) within `rects`, given the final `out`
    and `lse` of q's rows and the gradient `dout` of `out`."""
    dq = torch.zeros(q.shape, dtype=_acc_dtype(q), device=q.device)
    dk = torch.zeros(k.shape, dtype=_acc_dtype(k), device=k.device)
    dv = torch.zeros(v.shape, dtype=_acc_dtype(v), device=v.device)
    for b, qs, qe, ks, ke, causal in rects:
        rows, cols = (slice(b, b + 1), slice(None), slice(qs, qe)), (slice(b, b + 1), slice(None), slice(ks, ke))  # fmt: skip
        g_q, g_k, g_v = backward(dout[rows], q[rows], k[cols], v[cols], out[rows], lse[rows],
                                 causal, scale)  # fmt: skip
        dq[rows] += g_q
        dk[cols] += g_k
        dv[cols] += g_v
    return dq, dk, dv
