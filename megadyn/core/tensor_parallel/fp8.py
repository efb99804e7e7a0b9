"""FP8 GEMMs of the column- and row-parallel linear layers (--fp8-format, --fp8-recipe).

A layer given an `Fp8Recipe` runs its three GEMMs (forward y = x W^T, input gradient
g W, weight gradient g^T x) on float8 operands through `torch._scaled_mm`; everything else
(the communication of layers.py, the bias, norms, embedding, output layer) stays in the
model's dtype. Each operand is quantized just before its GEMM with a dynamic scale:

    amax  = max |t|               over the whole tensor (tensorwise) or, per row of the
                                  GEMM operand, over the contraction dimension (rowwise)
    scale = 2^floor(log2(fp8_max / amax))          a power of two (fp32)
    q     = clamp(t * scale, -fp8_max, fp8_max) -> float8, rounded to nearest even
    GEMM  = (q_a @ q_b) * (1 / scale_a) * (1 / scale_b), accumulated in fp32

Power-of-two scales make the dequantization exact: q * (1 / scale) is the float the GEMM
multiplies, so a quantize-dequantize computation in fp32 reproduces the GEMM's inputs bit
for bit (the CPU tests rely on it), at the price of up to one binade of fp8 range.

Formats (Megatron's names): 'e4m3' quantizes every operand to float8_e4m3fn (max 448);
'hybrid' keeps e4m3 for activations and weights and takes float8_e5m2 (max 57344, more
range, less precision) for the output gradient. Recipes: 'tensorwise' (one scale per
tensor; the forward's cast of x also writes the x^T in fp8 that the weight-gradient GEMM
takes; the backward keeps no fp8 W^T per micro batch: it takes the step's cached W^T
(below), else casts W^T again from W at the forward's scale, the same bits, as the weight
does not change between a micro batch's forward and backward) and 'rowwise' (a scale per
row of each GEMM operand; the backward re-quantizes x and W, kept in the model's dtype,
along the other dimension).

An input that the backward computes again (`recomputed_in_backward`, megadyn/core/
recomputed.py: under --pointwise-fusion the inputs of the blocks' four linear layers) is kept
in no form:
tensorwise saves x (the scope keeps a record instead) and the scale, not x^T, which the
backward casts again from the recomputed x at that scale (requantize: the forward's bits, no
amax, no all-reduce); rowwise saves x, which the scope replaces alike.

The forward GEMM uses the GPU's fast fp8 accumulation; the backward GEMMs do not. The
weight gradient is written in the weight's dtype and then added into `main_grad`
(`torch._scaled_mm` cannot accumulate into its output).

Tensor parallelism: an amax that spans a dimension sharded over tp is all-reduced (MAX)
over the tp group, so every rank quantizes with the scale the unsharded tensor would get and
tp > 1 computes what tp 1 does. Tensorwise: W always (sharded by rows or columns), x of a
row-parallel layer (its input dim is split), g of a column-parallel layer (its output dim).
Rowwise: only amaxes along a sharded contraction dimension (the input dim of a row-parallel
layer forward, the output dim of a column-parallel layer in the input gradient); the
weight-gradient GEMM contracts over tokens, which every rank holds whole (sequence
parallelism gathers them first).

There is no scaling state: scales are computed from the tensors of each step, so
checkpoints, snapshots and live reshards carry nothing for FP8. Inside one step's
`forward_backward` each weight is quantized once (its first micro batch: amax, tp all-reduce,
cast, transposed copy) and reused by the step's other forward and backward passes
(fp8_cache.py); activations and gradients are quantized at each GEMM. Without the cache
(CUDA graphs, outside a step) a tensorwise backward casts W^T at the scale its forward
agreed over tp: no amax, no collective.

CUDA needs compute capability 8.9 or newer. On CPU the same quantization runs, and the
GEMMs multiply the dequantized operands in fp32 (`emulated_mm`: the bits of torch's CPU
`_scaled_mm`, which is too slow to train with); tensorwise quantization on CUDA runs as two
Triton kernels (fp8_kernels.py), the rest as torch operations.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megadyn.core.recomputed import derived_in_backward, recomputed
from megadyn.core.tensor_parallel.fp8_cache import WeightCache
from megadyn.core.tensor_parallel.mappings import group_size

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "rowwise")
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
AMAX_FLOOR = 1e-12
"""An all-zero tensor is scaled as if its amax were this (its fp8 values are 0 anyway)."""
GEMM_MULTIPLE = 16
"""Every dimension of an fp8 GEMM (tokens, input and output size per rank) is a multiple
of this (the scaled-matmul kernels' alignment)."""


@dataclass(frozen=True)
class Fp8Recipe:
    """How the linear layers of the transformer blocks run their GEMMs in fp8."""

    format: str = "e4m3"
    """'e4m3' (every operand float8_e4m3fn) or 'hybrid' (gradients float8_e5m2) (--fp8-format)."""
    recipe: str = "tensorwise"
    """'tensorwise' (one dynamic scale per tensor) or 'rowwise' (one per row along the
    contraction dimension) (--fp8-recipe)."""
    weight_cache: bool = True
    """Each weight quantized once per step and kept (fp8_cache.py); False: at every use, one
    byte a weight (two tensorwise, with W^T) less held through the step (--no-fp8-weight-cache)."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"--fp8-format must be one of {FORMATS}, got {self.format!r}")
        if self.recipe not in RECIPES:
            raise ValueError(f"--fp8-recipe must be one of {RECIPES}, got {self.recipe!r}")
        if self.format == "hybrid" and self.recipe == "rowwise":
            raise ValueError(
                "--fp8-format hybrid runs with --fp8-recipe tensorwise only (row-wise scaled "
                "GEMMs take e4m3 operands): use --fp8-format e4m3 with rowwise"
            )

    @property
    def forward_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def grad_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn


def check_fp8_shapes(sizes: dict[str, int], tp: int, tokens: int) -> None:
    """ValueError naming the flag when a GEMM dimension is not a multiple of 16: `sizes`
    maps a flag to the global output or input size it sets (split over `tp`), `tokens` is
    the token count of one GEMM (micro batch x sequence per context-parallel rank)."""
    if tokens % GEMM_MULTIPLE:
        raise ValueError(
            f"--fp8-format needs the tokens of a micro batch ({tokens}) to be a multiple of "
            f"{GEMM_MULTIPLE}: change --micro-batch-size or --seq-length"
        )
    for flag, size in sizes.items():
        if size % (GEMM_MULTIPLE * tp):
            raise ValueError(
                f"--fp8-format needs {flag} ({size}) divisible by {GEMM_MULTIPLE} x "
                f"--tensor-model-parallel-size ({tp}): every rank's GEMM size must be a "
                f"multiple of {GEMM_MULTIPLE}"
            )


@functools.lru_cache(maxsize=None)
def _cuda_fp8_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def check_device(device: torch.device) -> None:
    if device.type == "cuda" and not _cuda_fp8_capable(device.index or 0):
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"--fp8-format needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
            f"{name} is {torch.cuda.get_device_capability(device)}: drop --fp8-format"
        )
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"--fp8-format runs on CUDA or CPU, not {device.type}")


def pow2_scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """2^floor(log2(fp8_max / amax)) in fp32: the exponent bits of the quotient, mantissa
    cleared (exact for every normal quotient)."""
    quotient = fp8_max / amax.float().clamp(min=AMAX_FLOOR)
    return (quotient.view(torch.int32) & 0x7F800000).view(torch.float32)


def quantize(
    t: torch.Tensor, dtype: torch.dtype, dim: int | None, group=None, transpose: bool = False
):
    """(q, inv_scale, q^T): `t` [m, n] in float8 `dtype`, the fp32 factor that dequantizes
    it, a scalar (`dim` None: tensorwise) or of shape [m, 1] / [1, n] (amax over `dim` 1 / 0),
    and with `transpose` q^T [n, m] contiguous (else None). The amax is all-reduced (MAX)
    over `group` when given (a sharded dimension)."""
    fp8_max = FP8_MAX[dtype]
    if dim is None and t.is_cuda:
        from megadyn.core.tensor_parallel.fp8_kernels import quantize_tensorwise

        return quantize_tensorwise(t, dtype, fp8_max, AMAX_FLOOR, group, transpose)
    # max |t| in one reduction (no |t| tensor written first), exact in any dtype
    amax = torch.linalg.vector_norm(t, float("inf"), dim=dim, keepdim=dim is not None).float()
    if group_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return _cast(t, dtype, pow2_scale(amax, fp8_max), transpose)


def requantize(
    t: torch.Tensor, dtype: torch.dtype, inv_scale: torch.Tensor, transpose=False, write_q=True
):
    """quantize(t, dtype, None, group, transpose) once more, given the `inv_scale` that call
    returned and t unchanged since: the same bits from the cast alone (no amax, nothing
    all-reduced: the scale was agreed over `group` then). `write_q` False (with `transpose`):
    q^T alone; on CUDA q is then neither written nor returned."""
    if t.is_cuda:
        from megadyn.core.tensor_parallel.fp8_kernels import quantize_tensorwise

        fp8_max = FP8_MAX[dtype]
        return quantize_tensorwise(
            t, dtype, fp8_max, AMAX_FLOOR, None, transpose, inv_scale, write_q
        )
    return _cast(t, dtype, inv_scale.reciprocal(), transpose)  # exact: a power of two


def requantize_t(t: torch.Tensor, dtype: torch.dtype, inv_scale: torch.Tensor) -> torch.Tensor:
    """x^T (from x [tokens, in] or W [out, in]) in fp8 at the forward's scale: requantize's
    q^T alone."""
    return requantize(t, dtype, inv_scale, transpose=True, write_q=False)[2]


def _cast(t: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor, transpose: bool):
    fp8_max = FP8_MAX[dtype]
    q = (t.float() * scale).clamp_(-fp8_max, fp8_max).to(dtype)  # keeps t's strides
    return q.contiguous(), scale.reciprocal(), q.t().contiguous() if transpose else None


def scaled_mm(a, a_inv, b, b_inv, out_dtype: torch.dtype, fast_accum=False, bias=None):
    """(a * a_inv) @ (b * b_inv) (+ bias) for a [m, k] row-major and b [k, n] column-major
    float8. CUDA's row-wise kernel writes bf16 only; other dtypes are cast from it. The bias
    goes into the GEMM's epilogue where the kernel takes it (tensorwise; on CUDA a bf16 bias
    and output). `fast_accum`: the GPU's faster fp8 accumulation (the forward GEMM only, as
    is usual). CPU: `emulated_mm`."""
    if not a.is_cuda:
        return emulated_mm(a, a_inv, b, b_inv, out_dtype, bias)
    dtype = torch.bfloat16 if a_inv.numel() > 1 else out_dtype
    fused_bias = bias is not None and a_inv.numel() == 1 and bias.dtype == dtype == torch.bfloat16
    y = torch._scaled_mm(
        a,
        b,
        a_inv,
        b_inv,
        bias=bias if fused_bias else None,
        out_dtype=dtype,
        use_fast_accum=fast_accum,
    )
    y = y if dtype == out_dtype else y.to(out_dtype)
    return y + bias if bias is not None and not fused_bias else y


def emulated_mm(a, a_inv, b, b_inv, out_dtype: torch.dtype, bias=None) -> torch.Tensor:
    """The CPU's scaled matmul: the dequantized operands (exact: power-of-two scales)
    multiplied in fp32, the bias added in fp32, one rounding to `out_dtype`. torch's CPU
    `_scaled_mm` computes the same bits (a test checks it) but by a plain loop, seconds for
    a 512 x 512 x 128 GEMM, so megadyn's CPU runs take this path."""
    y = (a.float() * a_inv) @ (b.float() * b_inv)  # [m, n] fp32
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _col_major(q: torch.Tensor) -> torch.Tensor:
    """The column-major [k, n] operand whose row-major transpose q [n, k] is held."""
    return q.t()


@dataclass(frozen=True)
class Fp8Gemms:
    """The fp8 GEMMs of one linear layer: `column` (W split by output rows) or row-parallel
    (W split by input columns) over `tp_group`, which decides whose amaxes are all-reduced.
    `weight_cache` keeps the quantized weight within a step (fp8_cache.weights_fixed)."""

    recipe: Fp8Recipe
    tp_group: object
    column: bool
    weight_cache: WeightCache = field(default_factory=WeightCache, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.weight_cache.enabled = self.recipe.weight_cache  # --no-fp8-weight-cache

    def _group(self, sharded: bool):
        return self.tp_group if sharded and group_size(self.tp_group) > 1 else None

    def _weight_t(self, weight: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
        """W^T [in, out] in fp8 at the forward's scale (1 / `ws`): the step's cached copy, else
        cast again from W, which has not changed since the forward (the optimizer steps after
        every micro batch's backward), so the bits are the forward's."""
        return self.weight_cache.get(
            "tensorwise",
            weight,
            lambda: requantize(weight, self.recipe.forward_dtype, ws, transpose=True),
            usable=lambda cached: cached[2] is not None,
        )[2]

    def forward(self, x2d, weight, bias, need_x: bool, need_w: bool):
        """(y [tokens, out] (+ bias), tensors for the backward) from x [tokens, in],
        W [out, in]; `need_x` / `need_w`: the backward computes the input / weight
        gradient."""
        check_device(x2d.device)
        tokens, (out, inp) = x2d.shape[0], weight.shape
        if tokens % GEMM_MULTIPLE or out % GEMM_MULTIPLE or inp % GEMM_MULTIPLE:
            raise ValueError(
                f"--fp8-format: GEMM [{tokens} tokens, {inp} in, {out} out] on this rank is "
                f"not a multiple of {GEMM_MULTIPLE} in every dimension; change "
                "--micro-batch-size, --seq-length, --hidden-size or --ffn-hidden-size"
            )
        fp8, row = self.recipe.forward_dtype, not self.column
        if self.recipe.recipe == "tensorwise":  # the backward takes x^T in fp8, W and ws
            again = need_w and recomputed(x2d)  # x^T: cast in the backward from x again
            xq, xs, xqt = quantize(x2d, fp8, None, self._group(row), transpose=need_w and not again)
            if again:  # x2d is saved as a record; the backward gets x^T at scale 1 / xs
                derived_in_backward(x2d, functools.partial(requantize_t, dtype=fp8, inv_scale=xs))
                xqt = x2d
            # W^T in the same pass only where the step's cache keeps it for the backward
            transpose = need_x and self.weight_cache.keeps(weight)
            wq, ws, _ = self.weight_cache.get(
                "tensorwise",
                weight,
                lambda: quantize(weight, fp8, None, self._group(True), transpose=transpose),
                usable=lambda cached: cached[2] is not None or not need_x,
            )
            y = scaled_mm(xq, xs, _col_major(wq), ws, x2d.dtype, x2d.is_cuda, bias)
            return y, (xqt, xs, weight, ws)
        xq, xs, _ = quantize(x2d, fp8, 1, self._group(row))  # [tokens, 1]
        wq, ws, _ = self.weight_cache.get(  # [out, 1]
            "rowwise", weight, lambda: quantize(weight, fp8, 1, self._group(row))
        )
        y = scaled_mm(xq, xs, _col_major(wq), ws.t(), x2d.dtype, x2d.is_cuda, bias)
        return y, (x2d, weight)

    def backward(self, saved, g2d: torch.Tensor, need_input: bool):
        """(d loss / d x [tokens, in] or None, weight_grad) from the output gradient
        g [tokens, out]; weight_grad(dtype) returns d loss / d W [out, in] in `dtype`, called
        after the input gradient's collective has started."""
        gdt, dtype = self.recipe.grad_dtype, g2d.dtype
        if self.recipe.recipe == "tensorwise":
            xqt, xs, weight, ws = saved  # x^T [in, t], W [out, in] (the parameter)
            if xqt is not None and xqt.dtype != self.recipe.forward_dtype:  # x, not derived
                xqt = requantize_t(xqt, self.recipe.forward_dtype, xs)
            gq, gs, gqt = quantize(g2d, gdt, None, self._group(self.column), transpose=True)
            grad_x = None
            if need_input:  # g [t, out] @ W [out, in]
                wqt = self._weight_t(weight, ws)
                grad_x = scaled_mm(gq, gs, _col_major(wqt), ws, dtype)

            def weight_grad(wdtype):  # g^T [out, t] @ x [t, in]
                return scaled_mm(gqt, gs, _col_major(xqt), xs, wdtype)

            return grad_x, weight_grad
        x2d, weight = saved
        grad_x = None
        if need_input:  # contraction over out: sharded in a column-parallel layer
            gq, gs, _ = quantize(g2d, gdt, 1, self._group(self.column))  # [t, 1]
            wq, ws, _ = self.weight_cache.get(  # [in, 1]
                "rowwise_t", weight, lambda: quantize(weight.t(), gdt, 1, self._group(self.column))
            )
            grad_x = scaled_mm(gq, gs, _col_major(wq), ws.t(), dtype)

        def weight_grad(wdtype):  # contraction over tokens: whole on every rank
            gq, gs, _ = quantize(g2d.t(), gdt, 1)  # [out, 1]
            xq, xs, _ = quantize(x2d.t(), self.recipe.forward_dtype, 1)  # [in, 1]
            return scaled_mm(gq, gs, _col_major(xq), xs.t(), wdtype)

        return grad_x, weight_grad
