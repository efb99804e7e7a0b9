"""Blockwise attention: one block of queries against one block of keys and values, with the
log-sum-exp that lets blocks computed apart be merged into the softmax over all keys.

    out, lse = block_forward(q, k, v, causal, scale)           # out [b, n, sq, d], lse [b, n, sq]
    merge_into(acc_out, acc_lse, out, lse)                    # softmax over both blocks' keys
    dq, dk, dv = block_backward(dout, q, k, v, out_all, lse_all, causal, scale)

`visible` [b, 1, sq, sk] (bool, optional) masks further: the documents of a packed sequence.
A query row that sees no key of a block gets output 0 and log-sum-exp -inf, which merging
ignores. `dropout` [b, n, sq, sk] (optional, dropout.py) scales the probabilities: 1/(1-p) where
kept, 0 where dropped. The log-sum-exp stays that of the undropped scores, so merged blocks give
the dropped softmax of the whole row, and the backward takes the same `dropout` again.

`block_backward` takes the *final* output and log-sum-exp of the query rows (over every key
block): exp(scores - lse_all) is then this block's share of the full softmax, so the gradients
of all blocks add up to the gradient of the whole attention (the flash-attention identity).

Queries have n heads, keys and values g heads (grouped-query attention: query head i reads
key head i // (n / g)). The arithmetic runs in fp32 for 16-bit inputs (in the input's precision
otherwise).
"""

from __future__ import annotations

import torch


def _acc(x: torch.Tensor) -> torch.Tensor:
    """`x` in the accumulation precision: fp32, or the input's if that is wider."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, g, s, d] -> [b, n, s, d], each key/value head repeated for its query heads."""
    groups = kv.shape[1]
    return kv if groups == heads else kv.repeat_interleave(heads // groups, dim=1)


def _reduce_heads(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, n, s, d] -> [b, g, s, d]: sum the gradients of the repeated heads."""
    b, n, s, d = grad.shape
    return grad if n == groups else grad.view(b, groups, n // groups, s, d).sum(2)


def _scores(q, k, causal: bool, scale: float, visible=None) -> torch.Tensor:
    """Scaled scores [b, n, sq, sk] in fp32, -inf above the diagonal when `causal` and where
    `visible` [b, 1, sq, sk] is False."""
    scores = torch.matmul(_acc(q), _acc(k).transpose(-1, -2)) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        above = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def block_forward(
    q, k, v, causal: bool, scale: float, visible=None, dropout=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [b, n, sq, d] over k, v [b, g, sk, d]: output [b, n, sq, d] (accumulation precision) and
    log-sum-exp of the scores [b, n, sq]."""
    heads = q.shape[1]
    scores = _scores(q, _expand(k, heads), causal, scale, visible)  # [b, n, sq, sk]
    lse = torch.logsumexp(scores, dim=-1)  # [b, n, sq]
    shift = lse
    if visible is not None:  # rows without a visible key: probabilities 0, not NaN
        shift = lse.masked_fill(lse == float("-inf"), 0.0)
    probs = torch.exp(scores - shift.unsqueeze(-1))
    if dropout is not None:
        probs = probs * dropout
    return torch.matmul(probs, _acc(_expand(v, heads))), lse


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out, block_lse) -> None:
    """Fold a block's (output, lse) into the running (out, lse) of the same query rows, in
    place: both become the attention over the union of their keys."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1))
    out.addcmul_(block_out, torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, visible=None, dropout=None):
    """Gradients (accumulation precision) of q, k, v for one block, given the final `out` and `lse` of q's rows
    and the gradient `dout` of `out`: dq [b, n, sq, d], dk and dv [b, g, sk, d]."""
    heads, groups = q.shape[1], k.shape[1]
    k_all, v_all = _acc(_expand(k, heads)), _acc(_expand(v, heads))
    dout = _acc(dout)
    scores = _scores(q, k_all, causal, scale, visible)  # [b, n, sq, sk]
    probs = torch.exp(scores - lse.unsqueeze(-1))
    kept = probs if dropout is None else probs * dropout
    dv = torch.matmul(kept.transpose(-1, -2), dout)  # [b, n, sk, d]
    dprobs = torch.matmul(dout, v_all.transpose(-1, -2))  # [b, n, sq, sk]
    if dropout is not None:
        dprobs = dprobs * dropout
    delta = (dout * _acc(out)).sum(-1, keepdim=True)  # [b, n, sq, 1]: out is the dropped one
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, k_all)  # [b, n, sq, d]
    dk = torch.matmul(dscores.transpose(-1, -2), _acc(q))  # [b, n, sk, d]
    return dq, _reduce_heads(dk, groups), _reduce_heads(dv, groups)
