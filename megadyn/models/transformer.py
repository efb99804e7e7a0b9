"""Transformer layer of megadyn's GPT: norm, self-attention, norm, MLP, with residuals.

Activations are [s, b, h] ([s/tp, b, h] between tensor-parallel regions under sequence
parallelism). One class serves the GPT-2 block (LayerNorm, GeLU, learned positions, biases)
and the Llama block (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases). Its pointwise
parts (norms, residual adds with their dropout, SwiGLU, RoPE) are pointwise.py's functions,
compiled under --pointwise-fusion.

The fused QKV weight is laid out per query group, [ng, (np/ng + 2) * d, h]: queries of the
group, then its key, then its value, so a split along dim 0 gives each tp rank whole groups.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megadyn.core.context_parallel import (
    context_parallel_attention,
    dynamic_attention,
    gather_heads,
    kernel_for_backend,
    scatter_heads,
)
from megadyn.core.recompute import RecomputeConfig, recompute
from megadyn.core.recomputed import recomputed_in_backward, replayed
from megadyn.core.tensor_parallel import (
    ColumnParallelLinear,
    RNGTracker,
    RowParallelLinear,
    group_size,
    mark_param,
)
from megadyn.models.attention import attention_kernels
from megadyn.models.config import GPTConfig
from megadyn.models.document_attention import DocumentMask, document_attention
from megadyn.models.pointwise import (
    Fusions,
    add_norm,
    dropout_add,
    fused_swiglu,
    norm,
    rope_qk,
    swiglu,
)
from megadyn.models.qkv_split import split_qkv


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the last dimension; replicated over tp."""

    def __init__(self, cfg: GPTConfig, sequence_parallel: bool, dtype, device):
        super().__init__()
        self.kind, self.eps = cfg.normalization, cfg.norm_epsilon
        self.fusions = Fusions.from_config(cfg)
        h = cfg.hidden_size
        self.weight = mark_param(
            nn.Parameter(torch.empty(h, dtype=dtype, device=device)), -1, sequence_parallel
        )
        self.bias = None
        if self.kind == "LayerNorm":
            self.bias = mark_param(
                nn.Parameter(torch.empty(h, dtype=dtype, device=device)), -1, sequence_parallel
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fusions(self.fusions.norm, norm, x)(x, self.weight, self.bias, self.eps)

    def again(self, x: torch.Tensor) -> tuple:
        """(fn, inputs) that compute forward(x) again in the backward, bit for bit: the
        compiled region's forward graph replayed (`replayed`) from x, which its backward keeps."""
        fn = self.fusions(self.fusions.norm, norm, x)
        return replayed(fn), x, self.weight, self.bias, self.eps


def input_recomputed(x: torch.Tensor, again: tuple | None):
    """The scope in which a linear layer keeps nothing of its input x when `again` (fn,
    *inputs) computes it again (`recomputed_in_backward`); a plain scope for None."""
    if again is None:
        return contextlib.nullcontext()
    return recomputed_in_backward(x, *again)


_KEEPS_OUTPUT = (  # scaled_dot_product_attention's kernels whose backward keeps `output`
    "ScaledDotProductFlashAttentionBackward",
    "ScaledDotProductEfficientAttentionBackward",
    "ScaledDotProductCudnnAttentionBackward",
    "ScaledDotProductFlashAttentionForCpuBackward",
)


def attention_keeps(out: torch.Tensor) -> bool:
    """Whether the backward of the kernel that made `out` keeps `out` itself (flash, efficient
    and cuDNN attention keep their output and its logsumexp; the math kernel, flex_attention,
    the context-parallel attentions and a padded or sliced output are not known to)."""
    node = out.grad_fn
    return (
        node is not None
        and out.output_nr == 0
        and node.name().rstrip("0123456789") in _KEEPS_OUTPUT
        and "_saved_output" in dir(node)
    )


def heads_to_hidden(out: torch.Tensor) -> torch.Tensor:
    """The attention's output [b, n, s, d] as linear_proj's input [s, b, n * d] (a copy
    unless the layout makes it a view)."""
    b, n, s, d = out.shape
    return out.permute(2, 0, 1, 3).reshape(s, b, n * d)


def rope_tables(seq_len: int, head_dim: int, base: float, device, dtype, positions=None):
    """cos and sin tables [s, d] for rotary embeddings (halves rotated, as Megatron and Llama)
    of positions 0 .. seq_len - 1, or of `positions` [s] (a context-parallel rank's tokens);
    [b, 1, s, d] for per-sample `positions` [b, s] (--reset-position-ids)."""
    inv = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    if positions is None:
        positions = torch.arange(seq_len, device=device)
    freqs = positions.to(device=device, dtype=torch.float32).unsqueeze(-1) * inv  # [(b,) s, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [(b,) s, d]
    if emb.dim() == 3:
        emb = emb.unsqueeze(1)  # [b, 1, s, d]: broadcast over heads
    return emb.cos().to(dtype), emb.sin().to(dtype)


class SelfAttention(nn.Module):
    """Causal self-attention; under context parallelism (`cp_group` of size > 1) over the
    whole sequence, whose other chunks the other cp ranks hold; within documents when given a
    `DocumentMask` (--reset-attention-mask)."""

    def __init__(
        self,
        cfg: GPTConfig,
        tp_group,
        sequence_parallel: bool,
        tracker,
        dtype,
        device,
        cp_group=None,
    ):
        super().__init__()
        tp = group_size(tp_group)
        self.cfg, self.tracker = cfg, tracker
        self.fusions = Fusions.from_config(cfg)
        self.cp_group = cp_group if group_size(cp_group) > 1 else None
        self.heads = cfg.num_attention_heads // tp  # query heads on this rank
        self.groups = cfg.query_groups // tp  # key/value heads on this rank
        self.q_per_group = cfg.num_attention_heads // cfg.query_groups
        qkv = cfg.query_groups * (self.q_per_group + 2) * cfg.head_dim
        kw = dict(
            bias=cfg.add_bias_linear,
            sequence_parallel=sequence_parallel,
            grad_accumulation_fusion=cfg.gradient_accumulation_fusion,
            comm_overlap=cfg.comm_overlap,
            fp8=cfg.fp8,
            dtype=dtype,
            device=device,
        )
        self.linear_qkv = ColumnParallelLinear(cfg.hidden_size, qkv, tp_group, **kw)
        self.linear_proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, tp_group, **kw)

    def core_attention(self, q, k, v, documents: DocumentMask | None = None):
        """softmax(q k^T / sqrt(d)) v, causal; q [b, n, s, d], k and v [b, g, s, d]."""
        p = self.cfg.attention_dropout if self.training else 0.0
        # under dropout the heads differ per tp rank: the tracker's per-rank stream
        fork = self.tracker.fork() if p > 0.0 and self.tracker is not None else None
        if self.cp_group is None:
            return self._whole_sequence(q, k, v, documents, p, fork)
        if self.cfg.cp_comm_type == "a2a":  # heads for sequence, then attention as without cp
            if p > 0.0:
                raise ValueError("--attention-dropout must be 0 with --cp-comm-type a2a")
            q, k, v = scatter_heads([q, k, v], self.cp_group)
            return gather_heads(self._whole_sequence(q, k, v, documents), self.cp_group)
        ids = None if documents is None else documents.packed
        if documents is not None and documents.cp_placement is not None:
            if p > 0.0:
                raise ValueError("--attention-dropout must be 0 with --cp-placement dynamic")
            kernel = kernel_for_backend(self.cfg.attention_backend)
            return dynamic_attention(q, k, v, self.cp_group, documents.cp_placement, kernel=kernel)
        with fork or contextlib.nullcontext():  # the cp masks' seed (context_parallel/)
            return context_parallel_attention(
                q,
                k,
                v,
                self.cp_group,
                self.cfg.cp_comm_type,
                document_ids=ids,
                backend=self.cfg.attention_backend,
                dropout_p=p,
            )

    def _whole_sequence(self, q, k, v, documents, p: float = 0.0, fork=None):
        """Attention over the whole sequence, held by this rank."""
        if documents is not None:
            if p > 0.0:
                raise ValueError("--attention-dropout must be 0 with --reset-attention-mask")
            return document_attention(q, k, v, documents)
        gqa = k.shape[1] != q.shape[1]
        with fork or contextlib.nullcontext(), attention_kernels(self.cfg.attention_backend, q):
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=p, is_causal=True, enable_gqa=gqa
            )

    def forward(
        self, x: torch.Tensor, rope=None, recompute_core: bool = False, documents=None, again=None
    ) -> torch.Tensor:
        """`again`: (fn, *inputs) that compute x again in the backward (the input norm's
        output), so linear_qkv keeps no copy of it."""
        with input_recomputed(x, again):
            qkv = self.linear_qkv(x)  # [s, b, g * (q + 2) * d]
        s, b = qkv.shape[:2]
        d = self.cfg.head_dim
        qkv = qkv.view(s, b, self.groups, self.q_per_group + 2, d)
        # views; the backward writes the three gradients into one tensor (qkv_split.py)
        q, k, v = split_qkv(qkv, self.q_per_group)  # q [s, b, g, q, d], k and v [s, b, g, 1, d]
        k, v = (t.squeeze(3).permute(1, 2, 0, 3) for t in (k, v))  # [b, g, s, d]
        if rope is None:
            q = q.reshape(s, b, self.heads, d).permute(1, 2, 0, 3)  # a copy: [b, n, s, d]
        else:  # RoPE writes q anew in qkv's order, where its heads merge as a view: no copy
            rope_fn = self.fusions(self.fusions.rope, rope_qk, q)
            q, k = rope_fn(q.permute(1, 2, 3, 0, 4), k, *rope)  # q [b, g, q, s, d]
            q = q.flatten(1, 2)  # [b, n, s, d]
        if recompute_core and torch.is_grad_enabled():
            out = recompute(self.core_attention, q, k, v, documents, tracker=self.tracker)
        else:
            out = self.core_attention(q, k, v, documents)  # [b, n, s, d]
        h = heads_to_hidden(out)  # [s, b, h/tp]
        # under the fusion linear_proj keeps no copy of h where the attention's backward
        # keeps `out` (not under selective recomputation, whose checkpoint drops it)
        keep = self.cfg.pointwise_fusion and not recompute_core and attention_keeps(out)
        with input_recomputed(h, (heads_to_hidden, out) if keep else None):
            return self.linear_proj(h)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, tp_group, sequence_parallel: bool, dtype, device):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        self.fusions = Fusions.from_config(cfg)
        self.keep_fc2_input = cfg.keep_fc2_input
        self.gelu_approximate = "tanh" if cfg.openai_gelu else "none"
        tp = group_size(tp_group)
        fc1_out = cfg.ffn_size * (2 if self.swiglu else 1)
        kw = dict(
            bias=cfg.add_bias_linear,
            sequence_parallel=sequence_parallel,
            grad_accumulation_fusion=cfg.gradient_accumulation_fusion,
            comm_overlap=cfg.comm_overlap,
            fp8=cfg.fp8,
            dtype=dtype,
            device=device,
        )
        # SwiGLU: local fc1 rows are [gate shard; up shard] (the global tensor is [gate; up])
        self.linear_fc1 = ColumnParallelLinear(
            cfg.hidden_size,
            fc1_out,
            tp_group,
            local_output_size=fc1_out // tp,
            **kw,
        )
        self.linear_fc2 = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, tp_group, **kw)

    def forward(self, x: torch.Tensor, again=None) -> torch.Tensor:
        """`again`: (fn, *inputs) that compute x again in the backward (the pre-MLP norm's
        output), so linear_fc1 keeps no copy of it."""
        with input_recomputed(x, again):
            y = self.linear_fc1(x)  # [s, b, ffn/tp] (x2 for SwiGLU)
        if not self.swiglu:
            return self.linear_fc2(F.gelu(y, approximate=self.gelu_approximate))
        fn = self.fusions(self.fusions.swiglu, swiglu, y)
        if fn is swiglu:  # not compiled: the plain ops
            return self.linear_fc2(swiglu(y))
        h = fused_swiglu(y, fn)  # the one-pass backward (swiglu_kernels.py)
        # fc2 keeps no copy of h, 16-bit or fp8, unless --keep-fc2-input
        with input_recomputed(h, None if self.keep_fc2_input else (fn, y)):
            return self.linear_fc2(h)


class TransformerLayer(nn.Module):
    def __init__(
        self,
        cfg: GPTConfig,
        tp_group,
        sequence_parallel: bool,
        tracker: RNGTracker | None,
        recompute_cfg: RecomputeConfig,
        dtype,
        device,
        cp_group=None,
    ):
        super().__init__()
        self.cfg, self.tracker = cfg, tracker
        self.sequence_parallel = sequence_parallel
        self.recompute_core = recompute_cfg.selective
        self.fusions = Fusions.from_config(cfg)
        # the norms' outputs, linear_qkv's and linear_fc1's inputs, computed again in the
        # backward; under sequence parallelism the layers keep the gathered inputs instead
        self.recompute_normed = (
            self.fusions.norm and not sequence_parallel and not cfg.keep_norm_outputs
        )
        self.input_layernorm = Norm(cfg, sequence_parallel, dtype, device)
        self.self_attention = SelfAttention(
            cfg, tp_group, sequence_parallel, tracker, dtype, device, cp_group
        )
        self.pre_mlp_layernorm = Norm(cfg, sequence_parallel, dtype, device)
        self.mlp = MLP(cfg, tp_group, sequence_parallel, dtype, device)

    def dropout(self, x: torch.Tensor) -> torch.Tensor:
        return hidden_dropout(
            x, self.cfg.hidden_dropout, self.training, self.sequence_parallel, self.tracker
        )

    def forward(self, x: torch.Tensor, rope=None, documents=None) -> torch.Tensor:
        again = self.input_layernorm.again(x) if self.recompute_normed else None
        h = self.input_layernorm(x)
        y = self.self_attention(h, rope, self.recompute_core, documents, again)
        x, h, again = self.add_norm(x, y)
        return self.residual_add(x, self.mlp(h, again))

    def add_norm(self, x: torch.Tensor, y: torch.Tensor) -> tuple:
        """x + dropout(y) and its pre-MLP norm, with (fn, *inputs) that compute the norm again
        in the backward from the sum, which the norm's backward keeps (None where linear_fc1
        keeps its input). The norm recomputed runs as a region of its own, replayed from the
        rounded sum as the forward read it; otherwise sum and norm are one compiled region
        when both fuse."""
        n, p = self.pre_mlp_layernorm, self.dropout_p
        if self.recompute_normed or not (self.fusions.residual and self.fusions.norm):
            x = self.residual_add(x, y)
            return x, n(x), n.again(x) if self.recompute_normed else None
        with self.dropout_rng(p):
            total, h = self.fusions(True, add_norm, x)(x, y, n.weight, n.bias, n.eps, p)
        return total, h, None

    def residual_add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x + dropout(y), compiled under the residual fusion when there is a dropout."""
        p = self.dropout_p
        if not (self.fusions.residual and p > 0.0):
            return x + self.dropout(y)
        with self.dropout_rng(p):
            return self.fusions(True, dropout_add, x)(x, y, p)

    @property
    def dropout_p(self) -> float:
        return self.cfg.hidden_dropout if self.training else 0.0

    def dropout_rng(self, p: float):
        """hidden_dropout's generator: the tracker's per-rank stream under sequence parallelism."""
        if p > 0.0 and self.sequence_parallel and self.tracker is not None:
            return self.tracker.fork()
        return contextlib.nullcontext()


def hidden_dropout(x, p: float, training: bool, sequence_parallel: bool, tracker) -> torch.Tensor:
    """Dropout of hidden states: replicated over tp (default stream) unless sequence-parallel."""
    if not training or p == 0.0:
        return x
    if sequence_parallel and tracker is not None:
        with tracker.fork():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)
