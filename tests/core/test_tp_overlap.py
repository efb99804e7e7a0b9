"""Tensor-parallel linear layers equal `F.linear` on the global weights, with their
communication overlapped (the column-parallel layer's input gradient all-reduced, or
reduce-scattered under sequence parallelism, beside the weight-gradient GEMM); with and
without gradient accumulation fusion into `main_grad`, a tied weight, and no input gradient;
under sequence parallelism also with --tp-comm-overlap's per-chunk GEMMs (sp_overlap.py)."""

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megadyn.testing import spawn

S, B, IN, OUT = 8, 2, 16, 24
WORLD = 4  # tp=2 runs two tp groups: group ranks differ from global ranks
TOL = dict(rtol=1e-5, atol=1e-5)


def global_problem():
    """Input [s, b, in], weight [out, in], bias [out] and output gradient [s, b, out]."""
    g = torch.Generator().manual_seed(3)
    return (
        torch.randn(S, B, IN, generator=g),
        torch.randn(OUT, IN, generator=g),
        torch.randn(OUT, generator=g),
        torch.randn(S, B, OUT, generator=g),
    )


def reference():
    x, w, b, dy = global_problem()
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    y = F.linear(x, w, b)
    (y * dy).sum().backward()
    tensors = {"x": x, "w": w, "b": b}
    return {"y": y.detach(), "dy": dy} | {
        key: value
        for name, t in tensors.items()
        for key, value in ((name, t.detach()), (f"{name}.grad", t.grad))
    }


def split_dims(cls, sp: bool) -> dict:
    """The dimension along which each global tensor is split over tp (None: replicated)."""
    if cls is ColumnParallelLinear:  # weight split along its output dimension
        return {"x": 0 if sp else None, "w": 0, "b": 0, "y": -1}
    return {"x": -1, "w": 1, "b": None, "y": 0 if sp else None}  # row: along the input


def local_pieces(ref: dict, cls, sp: bool, tp: int, rank: int) -> dict:
    """This rank's expected tensors: `ref` sliced as the layer splits them (a gradient as its
    tensor, the output gradient as the output)."""
    dims = split_dims(cls, sp)
    out = {}
    for name, t in ref.items():
        base = name.removesuffix(".grad")
        dim = dims["y" if base == "dy" else base]
        out[name] = t if dim is None else t.chunk(tp, dim)[rank]
    return out


def run_layer(cls, group, expected, *, sp, fuse, input_grad=True, tied=False, overlap=False):
    """Forward and backward of one layer holding this rank's weights; its output and grads."""
    kw = dict(sequence_parallel=sp, grad_accumulation_fusion=fuse, comm_overlap=overlap or None)
    if tied:
        kw["skip_weight"] = True
    layer = cls(IN, OUT, group, **kw)
    weight = torch.nn.Parameter(expected["w"].clone()) if tied else layer.weight
    with torch.no_grad():
        if not tied:
            weight.copy_(expected["w"])
        layer.bias.copy_(expected["b"])
    if fuse:  # a main_grad of another dtype than the weight turns fusion on (wgrad.py)
        weight.main_grad = torch.zeros(weight.shape, dtype=torch.float64)
    x = expected["x"].clone().requires_grad_(input_grad)
    y = layer(x, weight=weight) if tied else layer(x)
    (y * expected["dy"]).sum().backward()
    bias_grad = layer.bias.grad
    if cls is RowParallelLinear and sp:  # replicated bias, a partial grad per sequence chunk
        dist.all_reduce(bias_grad, group=group)
    fused = fuse and not tied
    assert getattr(weight, "grad_added_to_main_grad", False) == fused
    grads = {"y": y.detach(), "b.grad": bias_grad}
    grads["w.grad"] = weight.main_grad.float() if fused else weight.grad
    if input_grad:
        grads["x.grad"] = x.grad
    return grads


def body(rank, world, tp):
    groups = ParallelGroups.build(Layout(tp=tp, dp=world // tp), range(world))
    ref = reference()
    for cls, sp in itertools.product((ColumnParallelLinear, RowParallelLinear), (False, True)):
        expected = local_pieces(ref, cls, sp, tp, groups.tp_rank)
        runs = {
            fuse: run_layer(cls, groups.tp_group, expected, sp=sp, fuse=fuse)
            for fuse in (False, True)
        }
        if cls is ColumnParallelLinear:  # tied weight passed in: no fusion, plain grad
            runs["tied"] = run_layer(cls, groups.tp_group, expected, sp=sp, fuse=True, tied=True)
        runs["no input grad"] = run_layer(
            cls, groups.tp_group, expected, sp=sp, fuse=True, input_grad=False
        )
        if sp:  # --tp-comm-overlap: GEMMs split by sequence chunk beside the collectives
            for fuse, input_grad in ((False, True), (True, True), (True, False)):
                runs[f"overlap fuse={fuse} input grad={input_grad}"] = run_layer(
                    cls,
                    groups.tp_group,
                    expected,
                    sp=sp,
                    fuse=fuse,
                    input_grad=input_grad,
                    overlap="nccl",
                )
        plain = runs[False]
        for key, got in runs.items():
            what = f"{cls.__name__} tp={tp} sp={sp} {key}"
            for name, t in got.items():
                # (a) against the single-process layer
                torch.testing.assert_close(t, expected[name], **TOL, msg=f"{what} {name}")
                # (b) fusion against the plain path of the same layout (the overlap sums the
                # weight gradient chunk by chunk: rounding, so the absolute tolerance too)
                tol = TOL if str(key).startswith("overlap") else dict(rtol=1e-5, atol=0)
                torch.testing.assert_close(t, plain[name], **tol, msg=f"{what} {name}")
    groups.destroy()


@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_linear_with_overlap_matches_single_process(tp):
    spawn(body, world=WORLD, args=(tp,))


def reduce_scatter_body(rank, world):
    from megadyn.core.tensor_parallel.sp_overlap import (
        _reduce_scatter_by_gather,
        reduce_scatter_start,
    )

    groups = ParallelGroups.build(Layout(tp=2, dp=world // 2), range(world))
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(6, 3, 5, generator=gen)  # a partial sum [s, b, h] on each rank
    expected = torch.empty(3, 3, 5)
    dist.reduce_scatter_tensor(expected, x.clone(), group=groups.tp_group)
    got = _reduce_scatter_by_gather(x, groups.tp_group, "nccl")()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="--tp-comm-overlap-transport copy-engine needs CUDA"):
        reduce_scatter_start(x, groups.tp_group, "copy-engine")
    groups.destroy()


def test_the_gathered_reduce_scatter_equals_nccls():
    """tp = 2's reduce-scatter as an all-gather of the peer's rows (the copy-engine path's
    arithmetic, run here over gloo) against the collective reduce-scatter; the copy engines
    refuse CPU tensors."""
    spawn(reduce_scatter_body, world=WORLD)
