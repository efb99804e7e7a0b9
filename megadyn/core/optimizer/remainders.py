"""An fp32 main weight stored as its bf16 model weight plus a 16-bit remainder.

Under --use-precision-aware-optimizer (Megatron's flag; the layout of Transformer Engine's
FusedAdam with `store_param_remainders=True`) a bf16 parameter's shard keeps no fp32 main
copy: the bf16 weight the model computes with is the high half of the fp32 main value and an
int16 *remainder* holds the rest, so that the two give back the fp32 bits exactly:

    b  = the fp32 bits as int32
    hi = (b + 0x8000) >> 16          # arithmetic shift; its int16 bits, seen as bf16, are the weight
    lo = b - (hi << 16)              # in [-0x8000, 0x7FFF]: fits int16
    b  = (hi << 16) + lo             # join

This is computed on 16-bit halves, without int32 temporaries: `lo` is the low half of b read
as int16, and `hi` is the high half plus one when `lo` is negative (the low half >= 0x8000).
`hi` is round-to-nearest of the fp32 value in magnitude, except at exact ties (low half ==
0x8000), which round away from zero where `Tensor.to(torch.bfloat16)` rounds to even: the
model weight then differs from a cast by one bf16 unit in the last place. Finite values
never overflow; values above the largest bf16 round to bf16 inf (as a cast does), and join
gives their fp32 bits back. The 16-bit sums wrap, so join(split(b)) == b for every bit
pattern, NaN included; only a NaN whose high half is 0x7FFF or 0xFFFF and low half at least
0x8000 (not one torch's arithmetic makes) shows in the weight as a signed zero. Little-endian hosts only (the low
half comes first in memory), as on every device torch runs megadyn on.

Saves 2 bytes per parameter shard: 2 (remainder) instead of 4 (fp32 main).
"""

from __future__ import annotations

import sys

import torch

assert sys.byteorder == "little", "fp32 remainders read the low half of fp32 words first"


def _halves(fp32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The low and high int16 halves of a flat contiguous fp32 tensor (views)."""
    pairs = fp32.view(torch.int16).view(-1, 2)  # [n, 2]: low half, high half
    return pairs[:, 0], pairs[:, 1]


def split_into(main: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor) -> None:
    """Write flat fp32 `main` [n] as its bf16 `weight` (high half, rounded) and int16
    `remainder` [n]."""
    low, high = _halves(main.contiguous())
    weight.view(torch.int16).copy_(high - (low >> 15))  # low < 0: one up
    remainder.copy_(low)


def join_into(weight: torch.Tensor, remainder: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The fp32 values of bf16 `weight` + int16 `remainder` [n], written into flat fp32 `out`."""
    low, high = _halves(out)
    torch.add(weight.view(torch.int16), remainder >> 15, out=high)
    low.copy_(remainder)
    return out


def split(main: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 weight, int16 remainder) of flat fp32 `main`."""
    weight = torch.empty(main.shape, dtype=torch.bfloat16, device=main.device)
    remainder = torch.empty(main.shape, dtype=torch.int16, device=main.device)
    split_into(main, weight, remainder)
    return weight, remainder


def join(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The flat fp32 values of bf16 `weight` + int16 `remainder` (a new tensor)."""
    out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    return join_into(weight, remainder, out)


def model_weight(main: torch.Tensor) -> torch.Tensor:
    """The bf16 weight that goes with fp32 `main` (any shape): its rounded high half."""
    return split(main.reshape(-1))[0].view(main.shape)
