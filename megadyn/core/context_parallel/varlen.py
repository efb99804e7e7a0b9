"""Attention of packed query segments over packed key ranges in one kernel call: the call
dynamic cp (dynamic.py) makes once per layer for all of a rank's queries.

    plan = VarlenPlan.build(q_lengths, k_lengths, device)
    out, saved = varlen_forward(q, k, v, plan, scale)              # q [tq, n, d], k, v [tk, g, d]
    dq, dk, dv = varlen_backward(dout, q, k, v, out, saved, plan, scale)

Segment i is queries q[cu_q[i]:cu_q[i+1]] over keys k[cu_k[i]:cu_k[i+1]], at least as many keys
as queries, the queries being the last positions of the keys' range: a run of a document's
tokens over that document's keys from its start. Query j of a segment of lq queries and lk keys
sees keys 0 .. j + lk - lq (causal, aligned at the segment's end), so every query row sees at
least one key and no merging of partial results is needed.

On CUDA in 16-bit (head size up to 256) this is torch's flash attention with cumulative
lengths, one call for the forward and one for the backward; grouped queries (g < n) go in as
they are. Elsewhere (the CPU tests, fp32) blocks.py's math runs once per segment under the
same mask, which the GPU test compares with the flash call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megadyn.core.context_parallel.blocks import block_backward, block_forward

_aten = torch.ops.aten


@dataclass(frozen=True)
class VarlenPlan:
    """Where each segment's queries and keys sit in the packed q and k."""

    cu_q: list[int]
    """Cumulative query lengths [segments + 1] (host)."""
    cu_k: list[int]
    """Cumulative key lengths [segments + 1] (host)."""
    cu_q_dev: torch.Tensor
    cu_k_dev: torch.Tensor
    """The same, int32 where the attention runs (the flash kernel reads them there)."""

    @classmethod
    def build(cls, q_lengths: list[int], k_lengths: list[int], device) -> VarlenPlan:
        if any(lk < lq for lq, lk in zip(q_lengths, k_lengths)):
            raise ValueError("a varlen segment has fewer keys than queries")
        cu_q, cu_k = [0], [0]
        for lq, lk in zip(q_lengths, k_lengths):
            cu_q.append(cu_q[-1] + lq)
            cu_k.append(cu_k[-1] + lk)

        def dev(x):
            return torch.tensor(x, dtype=torch.int32, device=device)

        return cls(cu_q, cu_k, dev(cu_q), dev(cu_k))

    @property
    def max_q(self) -> int:
        return max(b - a for a, b in zip(self.cu_q, self.cu_q[1:]))

    @property
    def max_k(self) -> int:
        return max(b - a for a, b in zip(self.cu_k, self.cu_k[1:]))

    def segments(self):
        """(query slice, key slice) of each segment."""
        for i in range(len(self.cu_q) - 1):
            yield slice(self.cu_q[i], self.cu_q[i + 1]), slice(self.cu_k[i], self.cu_k[i + 1])


def uses_flash(q: torch.Tensor, kernel: str | None = None) -> bool:
    """The flash call runs for q [tq, n, d] (else the math per segment): CUDA, 16-bit, head
    size up to 256, and `kernel` (kernels.py's names) not "math"."""
    fused = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
    return fused and kernel != "math"


def _visible(lq: int, lk: int, device) -> torch.Tensor:
    """[1, 1, lq, lk]: query j sees keys up to j + lk - lq."""
    rows = torch.arange(lq, device=device).unsqueeze(1) + (lk - lq)
    return (torch.arange(lk, device=device).unsqueeze(0) <= rows).view(1, 1, lq, lk)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[t, h, d] -> [1, h, t, d] (blocks.py's layout)."""
    return x.transpose(0, 1).unsqueeze(0)


def varlen_forward(q, k, v, plan: VarlenPlan, scale: float, kernel: str | None = None):
    """Output [tq, n, d] (q's dtype) and what the backward needs."""
    if uses_flash(q, kernel):
        out, lse, rng, unused, _ = _aten._flash_attention_forward(
            q, k, v, plan.cu_q_dev, plan.cu_k_dev, plan.max_q, plan.max_k, 0.0, True, False,
            scale=scale,
        )  # fmt: skip
        return out, (lse, rng, unused)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for rows, cols in plan.segments():
        visible = _visible(rows.stop - rows.start, cols.stop - cols.start, q.device)
        o, s = block_forward(
            _heads_first(q[rows]), _heads_first(k[cols]), _heads_first(v[cols]), False, scale,
            visible,
        )  # fmt: skip
        out[rows] = o[0].transpose(0, 1).to(q.dtype)
        lse[:, rows] = s[0]
    return out, (lse,)


def varlen_backward(dout, q, k, v, out, saved, plan: VarlenPlan, scale: float, kernel=None):
    """Gradients of q [tq, n, d], k and v [tk, g, d], in their dtypes."""
    if uses_flash(q, kernel):
        lse, rng, unused = saved
        return _aten._flash_attention_backward(
            dout, q, k, v, out, lse, plan.cu_q_dev, plan.cu_k_dev, plan.max_q, plan.max_k, 0.0,
            True, rng, unused, scale=scale,
        )  # fmt: skip
    (lse,) = saved
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for rows, cols in plan.segments():
        visible = _visible(rows.stop - rows.start, cols.stop - cols.start, q.device)
        g_q, g_k, g_v = block_backward(
            _heads_first(dout[rows]), _heads_first(q[rows]), _heads_first(k[cols]),
            _heads_first(v[cols]), _heads_first(out[rows]), lse[:, rows].unsqueeze(0), False,
            scale, visible,
        )  # fmt: skip
        dq[rows] = g_q[0].transpose(0, 1).to(q.dtype)
        dk[cols] = g_k[0].transpose(0, 1).to(k.dtype)
        dv[cols] = g_v[0].transpose(0, 1).to(v.dtype)
    return dq, dk, dv
