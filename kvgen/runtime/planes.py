"""Byte views the generated copies of format-2 caches use: a connector of a cache made of
several parts or typed fields moves each plane (a part, or a field) as bytes, so planes of
different dtypes, fields at byte offsets inside a row and fields laid out per block all
move alike, and a memory object can hold them one after another in a row or as regions.

Every helper returns a view (never a copy), so the copies write where they read. The
conditions a view needs (a contiguous last dim, a contiguous block) are checked when a
cache is bound (`CacheReader.byte_rows`), before anything is written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kvgen.runtime.errors import KVLayoutError

#: Each plane's region of an object starts at a multiple of this many bytes, so a consumer
#: can view every region in its own dtype.
REGION_ALIGN = 16


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """`t` as bytes: the last dim grows by the element size (a 0-dim tensor becomes its
    bytes). Needs the last dim contiguous, as `CacheReader.byte_rows` checks."""
    if t.dim() == 0:
        t = t.unsqueeze(0)
    elif t.shape[-1] == 1 and t.stride(-1) != 1:
        t = t.squeeze(-1).unsqueeze(-1)  # a lone last element: give it stride 1
    return t.view(torch.uint8)


def row_field(t: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """Bytes [offset, offset + nbytes) of every row (last dim) of `t`."""
    return bytes_of(t).narrow(-1, offset, nbytes)


def block_field(t: torch.Tensor, offset: int, nbytes: int, n: int) -> torch.Tensor:
    """A field laid out per block: `t` ends in (N, C), each block's N x C elements are one
    run of bytes whose region [offset * N, (offset + nbytes) * N) holds the field of token
    0, 1, ... N - 1 in turn (`nbytes` each). Returns [..., N, nbytes]."""
    raw = bytes_of(t)
    flat = raw.view(*raw.shape[:-2], raw.shape[-2] * raw.shape[-1])
    return flat.narrow(-1, offset * n, nbytes * n).unflatten(-1, (n, nbytes))


def kv_row_field(t: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """Format 3 rows of K and V: the last dim of `t` is K's row then V's, each holding the
    fields; bytes [offset, offset + nbytes) of each half. Returns [..., 2, nbytes]."""
    return row_field(t.unflatten(-1, (2, -1)), offset, nbytes)


def cell_field(t: torch.Tensor, offset: int, nbytes: int, sides: bool) -> torch.Tensor:
    """A field laid out per run of cells (format 3): `t` ends in (H, N, C), or with `sides` in
    ([KV, H], N, C) (the K side's heads, then the V side's); each (block, side)'s H x N x C
    elements are one run of bytes whose region [offset * cells, (offset + nbytes) * cells)
    holds the field of each (h, n) cell in turn (`nbytes` each). Returns [..., (2,) H, N, nbytes]."""
    raw = bytes_of(t)
    if sides:
        raw = raw.unflatten(-3, (2, -1))
    shape = tuple(raw.shape[-3:-1])
    cells = shape[0] * shape[1]
    flat = raw.flatten(-3)
    return flat.narrow(-1, offset * cells, nbytes * cells).unflatten(-1, (*shape, nbytes))


def region(t: torch.Tensor, dim: int, offset: int, shape: Sequence[int], word: int = 1) -> torch.Tensor:
    """The dense region of `shape` (bytes) that starts `offset` bytes into dim `dim` of a byte
    tensor, as `word`-byte integers (the last dim of `shape` shrinks by `word`)."""
    size = 1
    for n in shape:
        size *= n
    return as_words(t.narrow(dim, offset, size).unflatten(dim, tuple(shape)), word)


def region_starts(sizes: Sequence[int]) -> tuple[int, ...]:
    """Where each region starts when regions of `sizes` bytes follow one another, each at a
    multiple of REGION_ALIGN."""
    out, at = [], 0
    for size in sizes:
        out.append(at)
        at += -(-size // REGION_ALIGN) * REGION_ALIGN
    return tuple(out)


def region_bytes(sizes: Sequence[int]) -> int:
    """Bytes a layer of regions of `sizes` takes (a multiple of REGION_ALIGN)."""
    return sum(-(-size // REGION_ALIGN) * REGION_ALIGN for size in sizes)


def units(nbytes: int, dtype: torch.dtype) -> int:
    """`nbytes` counted in elements of `dtype` (a rows object's C in the cache's dtype)."""
    item = torch.empty(0, dtype=dtype).element_size()
    if nbytes % item:
        raise KVLayoutError(f"a row of the cache's planes is {nbytes} bytes, not a whole number of "
                            f"{item}-byte {str(dtype).removeprefix('torch.')} elements: no object of that dtype "
                            "holds it")
    return nbytes // item


#: Integer types a plane's bytes move as (index kernels work per element: wider is faster).
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
WIDEST = 8


def word_of(*sizes: int) -> int:
    """The widest word (a power of two up to WIDEST bytes) dividing every byte count given."""
    g = 0
    for n in sizes:
        g = math.gcd(g, n)
    return WIDEST if g == 0 else min(WIDEST, g & -g)


def leaf_word(t: torch.Tensor, offset: int, nbytes: int, keep_last: bool) -> int:
    """The widest word a byte view of `t` allows for values `nbytes` long at `offset` in a row:
    its storage offset and the byte strides of its dims (the last one too, when `keep_last`:
    a part without C whose elements are the rows) must be whole words."""
    item = t.element_size()
    dims = range(t.dim()) if keep_last else range(t.dim() - 1)
    strides = [t.stride(d) * item for d in dims if t.shape[d] > 1]
    return word_of(offset, nbytes, t.storage_offset() * item, *strides)


def plane_words(g: Any, tensor: torch.Tensor, rows: bool) -> tuple[int, ...]:
    """Per plane, the word this call moves it in: what the cache allows (bound once, in
    `g.planes`) and what this object allows (its storage offset, strides and, for rows, where
    each plane starts in a row)."""
    item = tensor.element_size()
    base = word_of(tensor.storage_offset() * item,
                   *(tensor.stride(d) * item for d in range(tensor.dim() - 1) if tensor.shape[d] > 1))
    return tuple(min(p.word, base, word_of(g.plane_start(i)) if rows else base) for i, p in enumerate(g.planes))


def as_words(t: torch.Tensor, size: int) -> torch.Tensor:
    """A byte view as `size`-byte integers (the last dim shrinks by `size`). The word was
    chosen from the strides of dims with more than one element; torch also checks the
    strides of single-element (and empty) dims, which address nothing, so those are set to 0 first."""
    if size == 1:
        return t
    if any(n <= 1 and s % size for n, s in zip(t.shape, t.stride(), strict=True)):
        t = t.as_strided(t.shape, [0 if n <= 1 else s for n, s in zip(t.shape, t.stride(), strict=True)])
    return t.view(_WORDS[size])


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A plane without a slot axis (a per-layer scale): one plain copy."""
    dst.copy_(src)
