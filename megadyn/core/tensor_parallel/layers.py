"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Weights are allocated at their local (per-rank) shape and left uninitialized: the model fills
them from layout-independent global weights (see megadyn/models/sharding.py), so the same seed
gives the same model for every layout. Each parameter carries the attributes the gradient
and optimizer code read:

    param.tensor_model_parallel   sharded over tp (else replicated over tp)
    param.partition_dim           dimension of the shard, -1 when replicated
    param.sequence_parallel       replicated param whose grad is summed over tp under SP

Gradient accumulation fusion (`grad_accumulation_fusion`, on by default; wgrad.py): a bf16
layer's own weight gradient is added into its fp32 DDP `main_grad` inside the GEMM. fp32
models and modules without DDP take plain `F.linear`.

Communication overlap: a column-parallel layer all-reduces its input gradient (reduce-scatters
it under sequence parallelism) asynchronously while its weight gradient is computed. With
`comm_overlap` (sequence parallelism, --tp-comm-overlap: the transport, 'nccl' or
'copy-engine', best as `groups.comm_overlap(transport)`, which carries the layout's
communication resources) the all-gathers and the row-parallel reduce-scatter also run beside
per-chunk GEMMs (sp_overlap.py).

FP8 (`fp8`, an Fp8Recipe: --fp8-format, --fp8-recipe): the layer's three GEMMs take float8
operands with dynamic scales (fp8.py); the communication above is the same, and the weight
gradient, written in the weight's dtype, is added into `main_grad`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megadyn.core.tensor_parallel.fp8 import Fp8Gemms, Fp8Recipe
from megadyn.core.tensor_parallel.mappings import (
    gather_from_region,
    gather_sequence,
    group_rank,
    group_size,
    reduce_from_region,
    reduce_scatter_to_sequence,
)
from megadyn.core.tensor_parallel.sp_overlap import (
    Overlap,
    all_gather_linear,
    reduce_scatter_start,
    row_parallel_overlap,
)
from megadyn.core.tensor_parallel.wgrad import (
    add_to_main_grad,
    bias_grad,
    embedding_grad,
    fuse_wgrad,
    weight_grad,
)


class _LinearAsyncReduce(torch.autograd.Function):
    """y = x W^T + b, summed over `output_group` (row-parallel) after the GEMM. The input
    gradient, a partial sum over `input_group` (column-parallel), is all-reduced, or with
    `gather_input` (sequence parallelism: x [s/tp, b, in] is all-gathered along the sequence
    first) reduce-scattered, while the weight-gradient GEMM runs (which with `fuse` adds into
    `W.main_grad`).

    By default no GEMM is split to run beside a collective: in an eager step the extra launches
    of split GEMMs cost more than the overlap gives (measurements: BENCHMARKS.md). `overlap`
    (--tp-comm-overlap, for CUDA-graph steps, where launches cost nothing) splits the gathered
    GEMM by sequence chunk (sp_overlap.py)."""

    @staticmethod
    def forward(
        ctx, x, weight, bias, input_group, output_group, fuse, fuse_bias, gather_input, overlap, fp8
    ):
        y = None
        if gather_input and overlap:  # the own chunk's GEMM beside the all-gather
            x, y = all_gather_linear(x, weight, bias, input_group, overlap)
        elif gather_input:
            x = gather_sequence(x, input_group)  # [s, b, in]
        ctx.group, ctx.fuse, ctx.bias, ctx.fuse_bias = input_group, fuse, bias, fuse_bias
        ctx.gather_input, ctx.overlap, ctx.fp8 = gather_input, overlap, fp8
        ctx.x_shape = x.shape
        # the parameter itself, for its main_grad: under recomputation the saved tensors come
        # back as the recomputed forward's detached copies, which lack it
        ctx.weight = weight
        if y is not None:
            ctx.save_for_backward(x, weight)
            return y
        if group_size(output_group) > 1 and bias is not None:
            raise ValueError("a summed output takes its bias after the sum")
        if fp8 is not None:  # fp8 operands (tensorwise: x^T kept in fp8 for the backward)
            x2d, (need_x, need_w) = x.reshape(-1, x.shape[-1]), ctx.needs_input_grad[:2]
            y, saved = fp8.forward(x2d, weight, bias, need_x, need_w)  # [tokens, out]
            ctx.save_for_backward(*saved)
            y = y.view(*x.shape[:-1], y.shape[-1])
        else:
            ctx.save_for_backward(x, weight)
            y = F.linear(x, weight, bias)
        if group_size(output_group) > 1:
            dist.all_reduce(y, group=output_group)
        return y

    @staticmethod
    def backward(ctx, g):
        g2d = g.reshape(-1, g.shape[-1])  # [tokens, out]
        if ctx.fp8 is not None:
            grad_x, fp8_wgrad = ctx.fp8.backward(ctx.saved_tensors, g2d, ctx.needs_input_grad[0])
            grad_x = None if grad_x is None else grad_x.view(*ctx.x_shape)
        else:
            x, weight = ctx.saved_tensors
            grad_x = g.matmul(weight) if ctx.needs_input_grad[0] else None  # [..., in]
        wait, finish, grad_w = None, None, None
        if grad_x is not None:  # a partial sum over tp
            if ctx.gather_input:  # finish() returns the reduced grad_x
                finish = reduce_scatter_start(grad_x, ctx.group, ctx.overlap or "nccl")
            elif group_size(ctx.group) > 1:
                wait = dist.all_reduce(grad_x, group=ctx.group, async_op=True).wait
        if ctx.fp8 is None and ctx.needs_input_grad[1]:
            grad_w = weight_grad(ctx.weight, g2d, x.reshape(-1, x.shape[-1]), ctx.fuse)
        elif ctx.needs_input_grad[1]:  # fp8: in the weight's dtype, then into main_grad
            grad_w = fp8_wgrad(ctx.weight.dtype)
            grad_w = add_to_main_grad(ctx.weight, grad_w) if ctx.fuse else grad_w
        grad_b = bias_grad(ctx.bias, g2d, ctx.fuse_bias) if ctx.bias is not None else None
        if wait is not None:
            wait()
        if finish is not None:
            grad_x = finish()
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


def _linear(
    x,
    weight,
    bias,
    fuse: bool,
    input_group=None,
    output_group=None,
    gather_input=False,
    overlap=None,
    fp8=None,
):
    """F.linear with the input gradient all-reduced (or, with `gather_input`, the input
    all-gathered and its gradient reduce-scattered) over `input_group`, overlapped with the
    weight-gradient GEMM, or the output all-reduced over `output_group`; the weight gradient
    goes into `main_grad` when `fuse_wgrad` allows. `overlap` (sequence parallelism,
    --tp-comm-overlap: its transport) runs the own sequence chunk's GEMM beside the
    all-gather. `fp8` (an Fp8Gemms) runs the three GEMMs on float8 operands (fp8.py)."""
    fuse = fuse_wgrad(weight, fuse)
    fuse_bias = fuse and bias is not None and fuse_wgrad(bias, True)
    if fuse or fp8 or group_size(input_group) > 1 or group_size(output_group) > 1:
        return _LinearAsyncReduce.apply(
            x, weight, bias, input_group, output_group, fuse, fuse_bias, gather_input, overlap, fp8
        )
    return F.linear(x, weight, bias)


def _fp8_gemms(recipe: Fp8Recipe | None, tp_group, column: bool, comm_overlap) -> Fp8Gemms | None:
    if recipe is None:
        return None
    if comm_overlap:
        raise ValueError("--fp8-format does not run with --tp-comm-overlap yet: drop one of them")
    return Fp8Gemms(recipe, tp_group, column)


def mark_param(param: nn.Parameter, partition_dim: int = -1, sequence_parallel: bool = False):
    param.tensor_model_parallel = partition_dim >= 0
    param.partition_dim = partition_dim
    param.sequence_parallel = sequence_parallel
    return param


def _empty(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


def divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor-parallel size ({d})")
    return n // d


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split along its output dimension: [out/tp, in] per rank.

    Input [s, b, in] (or [s/tp, b, in] under sequence parallelism, all-gathered here);
    output [s, b, out/tp], or [s, b, out] with `gather_output`.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp_group,
        *,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        local_output_size: int | None = None,
        skip_weight: bool = False,
        grad_accumulation_fusion: bool = True,
        comm_overlap: Overlap | None = None,
        fp8: Fp8Recipe | None = None,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.grad_accumulation_fusion = grad_accumulation_fusion
        self.fp8 = _fp8_gemms(fp8, tp_group, column=True, comm_overlap=comm_overlap)
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.comm_overlap = comm_overlap if sequence_parallel else None
        tp = group_size(tp_group)
        local = local_output_size or divide(output_size, tp, "output size")
        self.weight = (
            None if skip_weight else mark_param(_empty((local, input_size), dtype, device), 0)
        )
        self.bias = mark_param(_empty((local,), dtype, device), 0) if bias else None

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        own_weight = weight is None  # a passed (tied) weight has another user: no fusion
        weight = self.weight if weight is None else weight
        fuse = own_weight and self.grad_accumulation_fusion
        # [s, b, out/tp]; the input gradient is all-reduced (reduce-scattered under sequence
        # parallelism, whose input [s/tp, b, in] is all-gathered) during the wgrad GEMM
        y = _linear(
            x,
            weight,
            self.bias,
            fuse,
            self.tp_group,
            gather_input=self.sequence_parallel,
            overlap=self.comm_overlap,
            fp8=self.fp8 if own_weight else None,  # a tied weight is the output layer's
        )
        if self.gather_output:
            y = gather_from_region(y, self.tp_group)  # [s, b, out]
        return y


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split along its input dimension: [out, in/tp] per rank.

    Input [s, b, in/tp]; output [s, b, out], or [s/tp, b, out] (reduce-scattered) under
    sequence parallelism. The bias is added once, after the reduction (at tp 1 in the GEMM).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp_group,
        *,
        bias: bool = True,
        sequence_parallel: bool = False,
        grad_accumulation_fusion: bool = True,
        comm_overlap: Overlap | None = None,
        fp8: Fp8Recipe | None = None,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.grad_accumulation_fusion = grad_accumulation_fusion
        self.fp8 = _fp8_gemms(fp8, tp_group, column=False, comm_overlap=comm_overlap)
        self.comm_overlap = comm_overlap if sequence_parallel else None
        local = divide(input_size, group_size(tp_group), "input size")
        self.weight = mark_param(_empty((output_size, local), dtype, device), 1)
        self.bias = (
            mark_param(_empty((output_size,), dtype, device), -1, sequence_parallel)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fuse = self.grad_accumulation_fusion
        if group_size(self.tp_group) == 1:  # nothing to sum: the bias goes into the GEMM
            return _linear(x, self.weight, self.bias, fuse, fp8=self.fp8)
        if self.comm_overlap:
            fuse = fuse_wgrad(self.weight, fuse)
            y = row_parallel_overlap(x, self.weight, self.tp_group, fuse, self.comm_overlap)
        elif self.sequence_parallel:
            y = _linear(x, self.weight, None, fuse, fp8=self.fp8)  # partial sums [s, b, out]
            y = reduce_scatter_to_sequence(y, self.tp_group)  # [s/tp, b, out]
        else:  # [s, b, out]
            y = _linear(x, self.weight, None, fuse, output_group=self.tp_group, fp8=self.fp8)
        if self.bias is not None:
            y = y + self.bias
        return y


def vocab_range(vocab_size: int, padded_vocab_size: int, tp_rank: int, tp: int) -> tuple[int, int]:
    """Rows [start, end) of the (unpadded) vocabulary held by `tp_rank`.

    The vocabulary is divided as if padded to `padded_vocab_size` (Megatron's rule), but padding
    rows are never allocated, so the model is the same function for every tp.
    """
    per = padded_vocab_size // tp
    start = min(tp_rank * per, vocab_size)
    end = min((tp_rank + 1) * per, vocab_size)
    return start, end


class _LookupIntoMainGrad(torch.autograd.Function):
    """y = W[ids]; the backward adds each token's output gradient into its row of W's
    `main_grad` (wgrad.embedding_grad)."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight  # the parameter itself, for its main_grad
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        return None, embedding_grad(ctx.weight, ids, grad)


def embedding(ids: torch.Tensor, weight: torch.Tensor, fuse: bool) -> torch.Tensor:
    """F.embedding(ids, weight); with `fuse` (wgrad.fuse_wgrad) its weight gradient goes
    straight into `main_grad`."""
    if fuse_wgrad(weight, fuse):
        return _LookupIntoMainGrad.apply(ids, weight)
    return F.embedding(ids, weight)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary; rank r holds rows vocab_range(r).

    Input token ids [b, s]; output [s, b, h] (all-reduced), or [s/tp, b, h] reduce-scattered
    under sequence parallelism. With `grad_accumulation_fusion` the table's gradient is
    accumulated into its fp32 `main_grad` row by row: only for a table that nothing else uses
    (not one tied to the output layer, whose gradient term autograd must sum with this one).
    """

    def __init__(
        self,
        vocab_size: int,
        padded_vocab_size: int,
        embedding_dim: int,
        tp_group,
        *,
        sequence_parallel: bool = False,
        grad_accumulation_fusion: bool = False,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.grad_accumulation_fusion = grad_accumulation_fusion
        tp, rank = group_size(tp_group), group_rank(tp_group)
        self.vocab_start, self.vocab_end = vocab_range(vocab_size, padded_vocab_size, rank, tp)
        if self.vocab_end <= self.vocab_start:
            raise ValueError(
                f"vocabulary of {vocab_size} leaves tensor-parallel rank {rank} of {tp} no rows; "
                "lower --tensor-model-parallel-size or --make-vocab-size-divisible-by"
            )
        rows = self.vocab_end - self.vocab_start
        self.weight = mark_param(_empty((rows, embedding_dim), dtype, device), 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.t()  # [s, b]
        fuse = self.grad_accumulation_fusion
        if group_size(self.tp_group) == 1:
            return embedding(ids, self.weight, fuse)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        y = embedding(local_ids, self.weight, fuse)  # [s, b, h] partial
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(y, self.tp_group)
        return reduce_from_region(y, self.tp_group)
