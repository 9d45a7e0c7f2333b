"""Layout facts a generated module carries, and the checks its generated `read_geometry` runs.

Reading and checking happen once per registered cache, never per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from kvgen.notation import format_layout
from kvgen.runtime.errors import KVLayoutError

Dims = tuple[tuple[str, ...], ...]  # per tensor dim: () singleton, (a,) one axis, (a, b) fused


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
        return format_layout(self.lists, self.dims, ext)

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
        return format_layout(self.lists, self.dims, ext)


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


class CacheReader:
    """The checks a generated `read_geometry` runs on one cache, in the order it calls them.

    The generated code says which dims hold which axes and which extents are fixed; this
    only checks, and every refusal names the expected layout and what was received."""

    def __init__(self, layout: PagedLayout, kvcaches: Any):
        self.layout = layout
        self.kvcaches = kvcaches

    def fail(self, why: str) -> NoReturn:
        expected = self.layout.arrow(dict(self.layout.sizes))
        raise KVLayoutError(f"{self.layout.name}: kvcaches must be {expected}: {why} "
                            f"(got {describe(self.kvcaches)})")

    def leaves(self) -> tuple[tuple[int, ...], torch.Tensor]:
        """The list levels' lengths and the first tensor, after checking that every tensor
        under the levels has one shape, dtype and device, the layout's rank and dtypes,
        real storage and no stride-0 dims."""
        lengths: list[int] = []
        level = [self.kvcaches]
        for axis in self.layout.lists:
            found, nxt = set(), []
            for node in level:
                if not isinstance(node, (list, tuple)):
                    self.fail(f"level {axis} must be a list or tuple, got {type(node).__name__}")
                found.add(len(node))
                nxt.extend(node)
            if len(found) != 1 or 0 in found:
                self.fail(f"level {axis} must be non-empty and the same length everywhere, got lengths "
                          f"{sorted(found)}")
            lengths.append(found.pop())
            level = nxt
        for node in level:
            if not isinstance(node, torch.Tensor):
                self.fail(f"expected tensors under the list levels, got {type(node).__name__}")
        first = level[0]
        for leaf in level[1:]:
            if leaf.shape != first.shape or leaf.dtype != first.dtype or leaf.device != first.device:
                self.fail(f"every tensor must have one shape, dtype and device; found {_placed(first)} and "
                          f"{_placed(leaf)}")
        if first.dim() != len(self.layout.dims):
            self.fail(f"tensors must have {len(self.layout.dims)} dims, got {first.dim()} "
                      f"(tensor[{', '.join(map(str, first.shape))}])")
        dtype_name = str(first.dtype).removeprefix("torch.")
        if dtype_name not in self.layout.dtypes:
            self.fail(f"dtype {dtype_name} is not one of {', '.join(self.layout.dtypes)}")
        if first.device.type == "meta":
            self.fail("cache tensors must have storage, got tensors on the meta device")
        for leaf in level:
            shared = broadcast_dims(leaf)
            if shared:
                self.fail(f"dims {shared} of a cache tensor have stride 0 (an expanded view), so distinct "
                          "slots would share memory; pass a tensor with its own storage")
        return tuple(lengths), first

    def singleton(self, index: int, extent: int) -> None:
        if extent != 1:
            self.fail(f"a singleton dim has extent {extent}")

    def fixed(self, axis: str, extent: int, value: int) -> None:
        if extent != value:
            self.fail(f"{axis} must be {value}, got {extent}")

    def split(self, label: str, extent: int, known: int) -> int:
        """The one unknown axis of a fused dim: its extent divided by the known axes'."""
        if known <= 0 or extent % known:
            self.fail(f"fused dim {label} has extent {extent}, which does not split as declared "
                      f"(the known axes multiply to {known})")
        return extent // known

    def fused(self, label: str, extent: int, product: int) -> None:
        if extent != product:
            self.fail(f"fused dim {label} has extent {extent}, but its axes multiply to {product}")

    def positive(self, **extents: int) -> None:
        empty = [f"{a}={v}" for a, v in extents.items() if v <= 0]
        if empty:
            self.fail(f"every extent must be positive, got {', '.join(empty)}")
