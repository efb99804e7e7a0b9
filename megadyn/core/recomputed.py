"""Saved tensors that the backward computes again instead of keeping (`recomputed_in_backward`).

    with recomputed_in_backward(h, fn, y):     # h is fn(y), bit for bit; y is kept anyway
        out = layer(h)                         # what `layer` saves of h is not kept

Inside the scope a saved-tensor hook replaces, in what the layers save for the backward:

    h, or a view of all of it     (the linear layers save [tokens, in] views) a record of the
                                  view; the backward computes fn(*inputs) again, takes the view
    a view announced with         a record of the view and `derive`; the backward gives
    `derived_in_backward`         derive(the view computed again): a tensor the layer would
                                  otherwise make from h in the forward and keep

The second is how an FP8 layer keeps nothing of its input (fp8.py): the weight-gradient GEMM
takes x^T in fp8, cast in the forward at a dynamic scale. A tensorwise layer whose input the
scope names saves the 16-bit input x (replaced by a record) and the scale (a scalar) instead,
announcing derive = the cast of x^T at that scale (fp8.requantize): the backward computes h
again, casts it, and gets the forward's bits, so the gradients are those of keeping x^T. The
16-bit h lives only while it is cast (fp8.requantize_t writes x^T alone). Should a saved-tensor hook opened inside the scope keep x itself, the
layer's backward casts that x at the saved scale: the same bits. A rowwise layer already saves its 16-bit input (its
backward quantizes x^T along tokens, which its forward never did): the record replaces it.

Worth it where the backward keeps `inputs` anyway and `fn` is cheap. Under --pointwise-fusion
(transformer.py) the four linear layers of a block keep no copy of their inputs:

    linear_qkv   the input norm's output, from the block's input, which the compiled norm's
                 backward keeps (one norm pass)
    linear_proj  the attention's output [b, n, s, d] as [s, b, h/tp], from that output, which
                 the backward of flash, efficient and cuDNN attention keeps (a copy, or a view
                 where the kernel writes [s, b, n, d]: then only a tensorwise FP8 layer's x^T
                 is saved); not for other kernels (math, flex_attention, context parallelism)
                 nor under selective recomputation, whose checkpoint drops the output
    linear_fc1   the pre-MLP norm's output, from the residual sum that the norm's backward
                 keeps (the norm then runs as a region of its own, not joined to the
                 residual add: the replay reads the rounded sum as the forward did)
    fc2          SwiGLU's output, from fc1's output, which SwiGLU's backward keeps (not
                 under --keep-fc2-input)

A compiled region is computed again through its forward graph (`replayed`: with gradients,
output detached), the kernels that computed it in the forward, as without gradients inductor
would compile an inference graph of its own, whose reductions it may block and round
otherwise (test_pointwise_gpu.py checks the bits). Sequence parallelism gathers the inputs of linear_qkv and linear_fc1 inside the
layer, which then saves the gathered tensor: those two keep it there (computing it again would
take an all-gather in the backward).

Off (a plain scope) without gradients and inside full recomputation, whose checkpoint decides
what is kept. Nothing here synchronizes with the host or allocates differently from step to
step (the backward's fn and cast take the shapes of the forward and the scale on the device;
a replay hits the graph compiled in the forward), so it runs under CUDA graphs; tensor and
sequence parallelism change shapes only (a row-parallel layer's input is its rank's shard; its
scale was agreed over tp in the forward).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
from torch.autograd.graph import saved_tensors_hooks


class _Recomputed:
    """What the backward holds instead of a saved tensor that it computes again."""

    __slots__ = ("shape", "stride", "offset", "derive")

    def __init__(self, t: torch.Tensor, base_offset: int, derive: Callable | None = None):
        self.shape, self.stride = t.shape, t.stride()
        self.offset = t.storage_offset() - base_offset
        self.derive = derive


def _geometry(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.shape, t.stride(), t.storage_offset(), t.dtype


class _Scope:
    """One open `recomputed_in_backward`: it holds no reference to `out` (the hooks live as
    long as the tensors they saved)."""

    def __init__(self, out: torch.Tensor, fn: Callable, inputs: tuple):
        self.ptr, self.numel, self.dtype = out.data_ptr(), out.numel(), out.dtype
        self.offset = out.storage_offset()
        self.fn, self.inputs = fn, inputs
        self.derived: dict[tuple, Callable] = {}  # announced views: their next save

    def names(self, t: torch.Tensor) -> bool:
        return t.data_ptr() == self.ptr and t.numel() == self.numel and t.dtype == self.dtype

    def pack(self, t: torch.Tensor):
        if not self.names(t):
            return t
        return _Recomputed(t, self.offset, self.derived.pop(_geometry(t), None))

    def unpack(self, saved):
        if not isinstance(saved, _Recomputed):
            return saved
        with torch.no_grad():
            again = self.fn(*self.inputs)
            view = again.as_strided(
                saved.shape, saved.stride, again.storage_offset() + saved.offset
            )
            return view if saved.derive is None else saved.derive(view)


_open = threading.local()


def _innermost() -> _Scope | None:
    scopes = getattr(_open, "scopes", None)
    return scopes[-1] if scopes else None


def recomputed(t: torch.Tensor) -> bool:
    """Whether `t` is the tensor (or a view of all of it) that the innermost open scope
    computes again in the backward instead of keeping it."""
    scope = _innermost()
    return scope is not None and scope.names(t)


def derived_in_backward(t: torch.Tensor, derive: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """When `t` (`recomputed(t)`) is next saved for the backward in this scope, the backward
    gets derive(t computed again) in its place (computed without gradients): a tensor of
    the layer's choosing (another dtype or shape) that it would have made from `t` itself."""
    _innermost().derived[_geometry(t)] = derive


def replayed(fn: Callable, output: int | None = None) -> Callable:
    """`fn` (a scope's fn) run in the backward as the forward ran it: with gradients, on its
    tensor arguments detached and requiring gradients as they do (parameters as they are),
    its output (or output[`output`]) detached. A compiled `fn` thus runs the forward graph it
    ran in the forward, the same kernels on the same inputs, the same bits; without gradients
    it would run an inference graph of its own, which inductor may fuse and round otherwise
    (a reduction of another shape of blocks)."""

    def again(*args):
        with torch.enable_grad():
            out = fn(*(_like(a) for a in args))
        return (out if output is None else out[output]).detach()

    return again


def _like(a):
    if not isinstance(a, torch.Tensor) or isinstance(a, torch.nn.Parameter):
        return a
    return a.detach().requires_grad_(a.requires_grad)


@contextlib.contextmanager
def recomputed_in_backward(out: torch.Tensor, fn: Callable, *inputs) -> Iterator[None]:
    """Within the scope, a tensor saved for the backward that is `out` (or a view of all of
    it: the linear layers save [tokens, in] views) is not kept: the backward computes it again
    as fn(*inputs), bit for bit the forward's `out` (or what `derived_in_backward` makes of
    it). Off (a plain scope) without gradients and inside full recomputation, whose
    checkpoint decides what is kept."""
    from megadyn.core.recompute import inside_recompute  # it imports fp8.py, which imports this

    if not torch.is_grad_enabled() or inside_recompute():
        yield
        return
    scope = _Scope(out, fn, inputs)
    if not hasattr(_open, "scopes"):
        _open.scopes = []
    _open.scopes.append(scope)
    try:
        with saved_tensors_hooks(scope.pack, scope.unpack):
            yield
    finally:
        _open.scopes.pop()
        scope.derived.clear()
