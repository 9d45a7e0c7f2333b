"""Layout facts a generated module carries, and reading a cache's geometry against them.

Reading and checking happen once per registered cache, never per token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvgen.runtime.errors import KVLayoutError

Dims = tuple[tuple[str, ...], ...]  # per tensor dim: () singleton, (a,) one axis, (a, b) fused


def _render_dim(axes: tuple[str, ...], ext: dict[str, int] | None) -> str:
    def one(a: str) -> str:
        return f"{a}={ext[a]}" if ext and a in ext else a

    if not axes:
        return "1"
    return "(" + " ".join(map(one, axes)) + ")" if len(axes) > 1 else one(axes[0])


def arrow(lists: Sequence[str], dims: Dims, ext: dict[str, int] | None = None) -> str:
    """The spec's arrow form, e.g. `L=4 -> [KV=2 B N H C]`."""
    levels = [f"{a}={ext[a]}" if ext and a in ext else a for a in lists]
    return " -> ".join([*levels, "[" + " ".join(_render_dim(d, ext) for d in dims) + "]"])


@dataclass(frozen=True)
class Geometry:
    """Extents of a registered cache. KV and H are 1 where the layout has none (MLA);
    N is None for a folded slot axis; S is the number of addressable slots."""

    L: int
    KV: int
    H: int
    C: int
    N: int | None
    S: int
    dtype: torch.dtype
    device: torch.device

    def extents(self) -> dict[str, int]:
        ext = {"L": self.L, "KV": self.KV, "H": self.H, "C": self.C, "S": self.S}
        if self.N is not None:
            ext.update(N=self.N, B=self.S // self.N)
        return ext


@dataclass(frozen=True)
class PagedLayout:
    name: str
    lists: tuple[str, ...]
    dims: Dims
    sizes: tuple[tuple[str, int], ...]
    dtypes: tuple[str, ...]

    def arrow(self, ext: dict[str, int] | None = None) -> str:
        return arrow(self.lists, self.dims, ext)

    def has(self, axis: str) -> bool:
        return axis in self.lists or any(axis in d for d in self.dims)


@dataclass(frozen=True)
class ObjectLayout:
    name: str
    format: str
    code: int
    accepts: tuple[str, ...]
    lists: tuple[str, ...]
    dims: Dims

    def arrow(self, ext: dict[str, int] | None = None) -> str:
        return arrow(self.lists, self.dims, ext)


def describe(value: Any, depth: int = 0) -> str:
    """A short account of what a caller passed: `list of 4 x tensor[2, 8, 16, 2, 4] bfloat16`
    (tensors off the CPU name their device)."""
    if isinstance(value, torch.Tensor):
        where = "" if value.device.type == "cpu" else f" on {value.device}"
        return f"tensor[{', '.join(map(str, value.shape))}] {str(value.dtype).removeprefix('torch.')}{where}"
    if isinstance(value, (list, tuple)) and depth < 3:
        inner = describe(value[0], depth + 1) if value else "nothing"
        return f"{type(value).__name__} of {len(value)} x {inner}"
    return type(value).__name__


def _placed(t: torch.Tensor) -> str:
    """`tensor[2, 8] float32 on cpu`: a tensor with its device, whichever it is."""
    return f"tensor[{', '.join(map(str, t.shape))}] {str(t.dtype).removeprefix('torch.')} on {t.device}"


def broadcast_dims(t: torch.Tensor) -> list[int]:
    """Dims of `t` whose elements share memory (stride 0 over more than one element, as
    `expand` makes): writing through them would overwrite one element with another."""
    return [i for i, (n, s) in enumerate(zip(t.shape, t.stride(), strict=True)) if n > 1 and s == 0]


def _leaves(layout: PagedLayout, kvcaches: Any, fail: Any) -> tuple[list[torch.Tensor], dict[str, int]]:
    ext: dict[str, int] = {}
    level = [kvcaches]
    for axis in layout.lists:
        lengths = set()
        nxt = []
        for node in level:
            if not isinstance(node, (list, tuple)):
                fail(f"level {axis} must be a list or tuple, got {type(node).__name__}")
            lengths.add(len(node))
            nxt.extend(node)
        if len(lengths) != 1 or 0 in lengths:
            fail(f"level {axis} must be non-empty and the same length everywhere, got lengths {sorted(lengths)}")
        ext[axis] = lengths.pop()
        level = nxt
    for node in level:
        if not isinstance(node, torch.Tensor):
            fail(f"expected tensors under the list levels, got {type(node).__name__}")
    return level, ext


def read_geometry(layout: PagedLayout, kvcaches: Any) -> Geometry:
    """Check `kvcaches` against the layout and return its extents, or raise KVLayoutError
    naming the expected layout and what was received."""

    expected = layout.arrow(dict(layout.sizes))

    def fail(why: str) -> None:
        raise KVLayoutError(f"{layout.name}: kvcaches must be {expected}: {why} "
                            f"(got {describe(kvcaches)})")

    leaves, ext = _leaves(layout, kvcaches, fail)
    first = leaves[0]
    for leaf in leaves[1:]:
        if leaf.shape != first.shape or leaf.dtype != first.dtype or leaf.device != first.device:
            fail(f"every tensor must have one shape, dtype and device; found {_placed(first)} and "
                 f"{_placed(leaf)}")
    if first.dim() != len(layout.dims):
        fail(f"tensors must have {len(layout.dims)} dims, got {first.dim()} "
             f"(tensor[{', '.join(map(str, first.shape))}])")
    dtype_name = str(first.dtype).removeprefix("torch.")
    if dtype_name not in layout.dtypes:
        fail(f"dtype {dtype_name} is not one of {', '.join(layout.dtypes)}")
    if first.device.type == "meta":
        fail("cache tensors must have storage, got tensors on the meta device")
    for leaf in leaves:
        shared = broadcast_dims(leaf)
        if shared:
            fail(f"dims {shared} of a cache tensor have stride 0 (an expanded view), so distinct "
                 "slots would share memory; pass a tensor with its own storage")

    fixed = dict(layout.sizes)
    slots = None
    fused: list[tuple[tuple[str, ...], int]] = []
    for axes, extent in zip(layout.dims, first.shape, strict=True):
        if not axes:
            if extent != 1:
                fail(f"a singleton dim has extent {extent}")
        elif axes == ("B", "N"):
            slots = extent
        elif len(axes) == 1:
            ext[axes[0]] = extent
        else:
            fused.append((axes, extent))
    for axis, value in fixed.items():
        if axis in ext and ext[axis] != value:
            fail(f"{axis} must be {value}, got {ext[axis]}")
        ext.setdefault(axis, value)
    for axes, extent in fused:
        unknown = [a for a in axes if a not in ext]
        known = math.prod(ext[a] for a in axes if a in ext)
        if len(unknown) == 1 and known > 0 and extent % known == 0:
            ext[unknown[0]] = extent // known
        if math.prod(ext.get(a, 0) for a in axes) != extent:
            fail(f"fused dim ({' '.join(axes)}) has extent {extent}, which does not split as declared "
                 f"(known: {', '.join(f'{a}={ext[a]}' for a in axes if a in ext) or 'nothing'})")
    if slots is None:
        slots = ext["B"] * ext["N"]
    empty = [f"{a}={v}" for a, v in ext.items() if v <= 0] + ([f"{slots} slots"] if slots <= 0 else [])
    if empty:
        fail(f"every extent must be positive, got {', '.join(empty)}")
    return Geometry(L=ext["L"], KV=ext.get("KV", 1), H=ext.get("H", 1), C=ext["C"], N=ext.get("N"),
                    S=slots, dtype=first.dtype, device=first.device)
