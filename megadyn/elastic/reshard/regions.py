"""Region arithmetic of the reshard planner: boxes, flat ranges, and regions of local tensors.

A held piece is a box of a global tensor (in its split view), possibly only a flat range of that
box's row-major flattening (a distributed-optimizer shard). A flat range is a union of at most
2*ndim-1 boxes that are each one contiguous run of the flattening (`flat_segments`):

    box [4, 6] (offsets (2, 0)), flat range [3, 20):
        row 0 cols 3..5  |  rows 1..2 (all cols)  |  row 3 cols 0..1

so the part of a piece that lies in another box is a few boxes, and every box addresses its
local tensor as `LocalRegion(start, shape, index)`: the contiguous run
`flat[start : start + prod(shape)]` viewed as `shape`, then sliced by `index`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Index = tuple[tuple[int, int], ...]
"""Per dimension (begin, end)."""


@dataclass(frozen=True)
class Segment:
    """A box that is one contiguous run of a rect's flattening."""

    flat_start: int
    """Where the run starts within the rect's flattening."""
    origin: tuple[int, ...]
    """Global (view) coordinates of the box's first element."""
    shape: tuple[int, ...]


def flat_segments(
    start: int, end: int, offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> list[Segment]:
    """Boxes covering elements [start, end) of the row-major flattening of a rect.

    The rect sits at `offsets` with `sizes` in global coordinates; the boxes come in order.
    """
    if start >= end:
        return []
    if len(sizes) <= 1:
        origin = tuple(o + start for o in offsets)
        return [Segment(start, origin, (end - start,) if sizes else ())]
    inner = math.prod(sizes[1:])
    first, last = start // inner, (end - 1) // inner  # rows touched

    def row_part(row: int, lo: int, hi: int) -> list[Segment]:
        sub = flat_segments(lo, hi, offsets[1:], sizes[1:])
        base = row * inner
        return [
            Segment(base + s.flat_start, (offsets[0] + row,) + s.origin, (1,) + s.shape)
            for s in sub
        ]

    if first == last:
        return row_part(first, start - first * inner, end - first * inner)
    out = []
    full_lo, full_hi = first, last + 1
    if start % inner:
        out += row_part(first, start % inner, inner)
        full_lo += 1
    if end % inner:
        full_hi -= 1
    if full_hi > full_lo:
        origin = (offsets[0] + full_lo,) + tuple(offsets[1:])
        out.append(Segment(full_lo * inner, origin, (full_hi - full_lo,) + tuple(sizes[1:])))
    if end % inner:
        out += row_part(last, 0, end % inner)
    return out


def intersect(
    a_origin: tuple[int, ...],
    a_shape: tuple[int, ...],
    b_origin: tuple[int, ...],
    b_shape: tuple[int, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(origin, shape) of the intersection of two boxes, None when it is empty."""
    origin, shape = [], []
    for ao, an, bo, bn in zip(a_origin, a_shape, b_origin, b_shape):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if lo >= hi:
            return None
        origin.append(lo)
        shape.append(hi - lo)
    return tuple(origin), tuple(shape)


@dataclass(frozen=True)
class LocalRegion:
    """Part of a flattened local tensor: flat[start : start + prod(shape)].view(shape)[index]."""

    start: int
    shape: tuple[int, ...]
    index: Index

    @property
    def numel(self) -> int:
        return math.prod(e - b for b, e in self.index)

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(e - b for b, e in self.index)

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """This region of the 1-D tensor `flat` (a view)."""
        run = flat[self.start : self.start + math.prod(self.shape)].view(self.shape)
        return run[tuple(slice(b, e) for b, e in self.index)]

    def within(self, numel: int) -> bool:
        """True when the region lies inside a local tensor of `numel` elements."""
        inside = all(0 <= b < e <= n for (b, e), n in zip(self.index, self.shape))
        return inside and 0 <= self.start and self.start + math.prod(self.shape) <= numel

    def sub(self, rel: Index) -> LocalRegion:
        """The part `rel` (relative to this region's index) of this region."""
        index = tuple((b + rb, b + re) for (b, _), (rb, re) in zip(self.index, rel))
        return LocalRegion(self.start, self.shape, index)


def split_lengths(lengths: tuple[int, ...], max_numel: int) -> list[Index]:
    """Cut a box of `lengths` into boxes of at most `max_numel` elements (relative indices)."""
    whole = tuple((0, n) for n in lengths)
    if math.prod(lengths) <= max_numel or not lengths:
        return [whole]
    d = next(i for i, n in enumerate(lengths) if n > 1)
    inner = math.prod(lengths[d + 1 :])
    step = max(1, max_numel // inner)
    out = []
    for lo in range(0, lengths[d], step):
        hi = min(lo + step, lengths[d])
        if hi - lo == 1 and inner > max_numel:  # one slice is still too large: cut deeper
            for rel in split_lengths(lengths[d + 1 :], max_numel):
                out.append(whole[:d] + ((lo, hi),) + rel)
        else:
            out.append(whole[:d] + ((lo, hi),) + whole[d + 1 :])
    return out
