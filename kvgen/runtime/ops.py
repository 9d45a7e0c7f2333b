"""Tiny tensor helpers the generated copies share."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kvgen.runtime.movers.program import Place

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as integers of the same width: copies then move bits exactly, and dtypes
    without index kernels on some devices (float8 on CPU) take the same path."""
    if not t.dtype.is_floating_point and not t.dtype.is_complex:
        return t
    return t.view(_SAME_WIDTH_INT[t.element_size()])


def placed(t: torch.Tensor, places: Sequence[Place], g: Any) -> torch.Tensor:
    """`t` with one dim per planned place (a PROGRAM's `cache_places` or `object_places`), in
    their order: each axis steps by the stride of its tensor dim times the extents of the axes
    after it there. In a fused dim every axis but the last has its extent on the geometry `g`
    and the last the rest of the dim (so C counts the words `t` is viewed in); an axis alone
    in its dim is the dim. Singleton dims hold no place and drop out. A view of `t` (torch
    refuses one reaching past its storage), so the movers index only what `places` name."""
    shape, stride = t.shape, t.stride()
    size: dict[str, int] = {}
    i = 0
    while i < len(places):  # the extents of each run of places in one dim
        dim, j = places[i][1], i
        while j < len(places) and places[j][1] == dim:
            j += 1
        outer = [int(getattr(g, p[0])) for p in places[i:j - 1]]
        size.update(zip((p[0] for p in places[i:j]), [*outer, shape[dim] // max(1, math.prod(outer))], strict=True))
        i = j
    sizes = [size[a] for a, _, _ in places]
    steps = [stride[dim] * math.prod(size[b] for b in inner) for _, dim, inner in places]
    return t.as_strided(sizes, steps, t.storage_offset())


def put_tokens(dst: torch.Tensor, dim: int, tok: torch.Tensor | None, src: torch.Tensor) -> None:
    """Write `src` into `dst` at token positions `tok` along `dim` (all of them when None)."""
    if tok is None:
        dst.copy_(src)
    else:
        dst.index_copy_(dim, tok, src)


def take_tokens(src: torch.Tensor, dim: int, tok: torch.Tensor | None) -> torch.Tensor:
    """The token positions `tok` of `src` along `dim` (all of them when None)."""
    return src if tok is None else src.index_select(dim, tok)


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """`t` as [rows, row] when each row (all dims after the first) is one contiguous run."""
    if t.dim() > 1 and t.shape[0] > 0 and t[0].is_contiguous():
        return t.view(t.shape[0], -1)
    return None


def take_rows(src: torch.Tensor, index: torch.Tensor | slice, out: torch.Tensor) -> None:
    """out[i] = src[index[i]] along dim 0, one memcpy per row when rows are contiguous."""
    if isinstance(index, slice):
        out.copy_(src[index])
        return
    src2, out2 = _rows(src), _rows(out)
    if src2 is not None and out2 is not None:
        torch.index_select(src2, 0, index, out=out2)
    else:
        torch.index_select(src, 0, index, out=out)


def put_rows(dst: torch.Tensor, index: torch.Tensor | slice, src: torch.Tensor) -> None:
    """dst[index[i]] = src[i] along dim 0, row-wise when rows are contiguous."""
    if isinstance(index, slice):
        dst[index].copy_(src)
        return
    dst2, src2 = _rows(dst), _rows(src)
    if dst2 is not None and src2 is not None:
        dst2.index_copy_(0, index, src2)
    else:
        dst.index_copy_(0, index, src)


def gather_slots(src: torch.Tensor, slots: torch.Tensor | slice, dst: torch.Tensor,
                 tok: torch.Tensor | None) -> None:
    """dst[tok[i]] = src[slots[i]] (dst[i] when tok is None), slots and tokens on dim 0."""
    if tok is None:
        take_rows(src, slots, dst)
    else:
        dst.index_copy_(0, tok, src.index_select(0, slots))


def scatter_slots(dst: torch.Tensor, slots: torch.Tensor | slice, src: torch.Tensor,
                  tok: torch.Tensor | None) -> None:
    """dst[slots[i]] = src[tok[i]] (src[i] when tok is None), slots and tokens on dim 0."""
    put_rows(dst, slots, src if tok is None else src.index_select(0, tok))


def take_index(src: torch.Tensor, dim: int, index: torch.Tensor | slice, out: torch.Tensor) -> None:
    """out = src.index_select(dim, index), written in place: one plain copy for a slice,
    else an index over dim 0 of both tensors with `dim` moved first (views): torch's CPU
    index_select over another dim of a strided view goes element by element (measured 200x
    slower on a HiCache page-first cache's layer view), over dim 0 it copies whole rows."""
    if isinstance(index, slice):
        out.copy_(src.narrow(dim, index.start, index.stop - index.start))
    else:
        take_rows(src.movedim(dim, 0), index, out.movedim(dim, 0))


def put_index(dst: torch.Tensor, dim: int, index: torch.Tensor | slice, src: torch.Tensor) -> None:
    """dst.index_copy_(dim, index, src), likewise over dim 0 of both (index_copy_ over a
    non-leading dim of a strided view measured 3-4x slower)."""
    if isinstance(index, slice):
        dst.narrow(dim, index.start, index.stop - index.start).copy_(src)
    else:
        put_rows(dst.movedim(dim, 0), index, src.movedim(dim, 0))
