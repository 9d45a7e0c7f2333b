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
    """A short account of what a caller passed: `list of 4 x tensor[2, 8, 16, 2, 4] bfloat16`."""
    if isinstance(value, torch.Tensor):
        return f"tensor[{', '.join(map(str, value.shape))}] {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (list, tuple)) and depth < 3:
        inner = describe(value[0], depth + 1) if value else "nothing"
        return f"{type(value).__name__} of {len(value)} x {inner}"
    return type(value).__name__


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

    def fail(why: str) -> None:
        raise KVLayoutError(f"{layout.name}: kvcaches do not match {layout.arrow()}: {why} "
                            f"(got {describe(kvcaches)})")

    leaves, ext = _leaves(layout, kvcaches, fail)
    first = leaves[0]
    for leaf in leaves[1:]:
        if leaf.shape != first.shape or leaf.dtype != first.dtype or leaf.device != first.device:
            fail(f"every tensor must have one shape, dtype and device; found {describe(first)} on "
                 f"{first.device} and {describe(leaf)} on {leaf.device}")
    if first.dim() != len(layout.dims):
        fail(f"tensors must have {len(layout.dims)} dims, got {first.dim()}")
    dtype_name = str(first.dtype).removeprefix("torch.")
    if dtype_name not in layout.dtypes:
        fail(f"dtype {dtype_name} is not one of {', '.join(layout.dtypes)}")

    fixed = dict(layout.sizes)
    slots = None
    fused: list[tuple[tuple[str, ...], int]] = []
    for axes, extent in zip(layout.dims, first.shape):
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
        if len(unknown) == 1 and extent % known == 0:
            ext[unknown[0]] = extent // known
        if math.prod(ext.get(a, 0) for a in axes) != extent:
            fail(f"fused dim ({' '.join(axes)}) has extent {extent}, which does not split as declared")
    if slots is None:
        slots = ext["B"] * ext["N"]
    if slots <= 0 or any(ext.get(a, 1) <= 0 for a in ("L", "H", "C")):
        fail("every extent must be positive")
    return Geometry(L=ext["L"], KV=ext.get("KV", 1), H=ext.get("H", 1), C=ext["C"], N=ext.get("N"),
                    S=slots, dtype=first.dtype, device=first.device)
