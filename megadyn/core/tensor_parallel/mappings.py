"""Autograd communication functions of tensor parallelism; each takes its process group.

Activations are laid out [s, b, h]. "Region" means the part of the network between a
column-parallel and a row-parallel layer, where the last dimension is split over tp.

    copy_to_region          fwd: identity            bwd: all-reduce
    reduce_from_region      fwd: all-reduce          bwd: identity
    scatter_to_region       fwd: split last dim      bwd: all-gather last dim
    gather_from_region      fwd: all-gather last     bwd: split last dim
    scatter_to_sequence     fwd: split dim 0         bwd: all-gather dim 0
    gather_from_sequence    fwd: all-gather dim 0    bwd: reduce-scatter dim 0 (or split)
    reduce_scatter_to_sequence fwd: reduce-scatter 0 bwd: all-gather dim 0

A group of None (or of size 1) makes every function the identity, so the single-process model
is the same code with `tp_group=None`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megadyn.core.distributed.comm import all_gather_flat, reduce_scatter_flat


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x, group):
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x, group):
    size = group_size(group)
    if size == 1:
        return x
    return x.chunk(size, dim=-1)[group_rank(group)].contiguous()


def _gather_last(x, group):
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((size,) + x.shape, dtype=x.dtype, device=x.device)  # [tp, ..., h/tp]
    all_gather_flat(out, x, group)
    return torch.cat(out.unbind(0), dim=-1)


def _split_first(x, group):
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tp {size}")
    return x.chunk(size, dim=0)[group_rank(group)].contiguous()


def gather_sequence(x, group):
    """All-gather along dim 0 (no autograd): [s/tp, ...] -> [s, ...]."""
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((size * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)
    all_gather_flat(out, x, group)  # [s, b, h] from [s/tp, b, h]
    return out


def reduce_scatter_sequence(x, group, async_op: bool = False):
    """Reduce-scatter partial sums along dim 0 (no autograd): [s, ...] -> [s/tp, ...]; with
    `async_op`, (output, work handle or None) so the caller can overlap it."""
    size = group_size(group)
    if size == 1:
        return (x, None) if async_op else x
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size,) + x.shape[1:], dtype=x.dtype, device=x.device)
    # [s/tp, b, h] from partial [s, b, h]
    work = reduce_scatter_flat(out, x, group, async_op=async_op)
    return (out, work) if async_op else out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _split_last(g, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, g):
        return gather_sequence(g, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_grad_is_partial):
        ctx.group = group
        ctx.partial = output_grad_is_partial
        return gather_sequence(x, group)

    @staticmethod
    def backward(ctx, g):
        if ctx.partial:
            return reduce_scatter_sequence(g, ctx.group), None, None
        return _split_first(g, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, g):
        return gather_sequence(g, ctx.group), None


def copy_to_region(x, group):
    return _CopyToRegion.apply(x, group) if group_size(group) > 1 else x


def reduce_from_region(x, group):
    return _ReduceFromRegion.apply(x, group) if group_size(group) > 1 else x


def scatter_to_region(x, group):
    return _ScatterToRegion.apply(x, group) if group_size(group) > 1 else x


def gather_from_region(x, group):
    return _GatherFromRegion.apply(x, group) if group_size(group) > 1 else x


def scatter_to_sequence(x, group):
    return _ScatterToSequence.apply(x, group) if group_size(group) > 1 else x


def gather_from_sequence(x, group, output_grad_is_partial: bool = True):
    """All-gather along the sequence; the gradient is reduce-scattered when it is a partial sum
    (the gathered tensor feeds a tensor-parallel matmul), else split."""
    if group_size(group) == 1:
        return x
    return _GatherFromSequence.apply(x, group, output_grad_is_partial)


def reduce_scatter_to_sequence(x, group):
    return _ReduceScatterToSequence.apply(x, group) if group_size(group) > 1 else x
