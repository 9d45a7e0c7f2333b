"""Layout facts a generated module carries, and the checks its generated `read_geometry` runs.

Reading and checking happen once per registered cache, never per token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from kvgen.notation import format_layout
from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.planes import leaf_word

Dims = tuple[tuple[str, ...], ...]  # per tensor dim: () singleton, (a,) one axis, (a, b) fused


@dataclass(frozen=True)
class PlaneGeometry:
    """One plane of a format-2 cache (a part, or a field of a part): its name and C, the
    bytes of one value row (one token, K or V, head)."""

    name: str
    C: int
    #: The widest word (bytes) every tensor of the cache allows for this plane's rows.
    word: int = 1
    #: A whole part's plane: its C in the part's values (None for a field of a part, whose
    #: width the spec fixes).
    values: int | None = None


@dataclass(frozen=True)
class Geometry:
    """Extents of a registered cache. KV and H are 1 where the layout has none (MLA);
    N is None for a folded slot axis; S is the number of addressable slots. A format-2
    cache adds its planes (C is then the first part's C, dtype the first part's)."""

    L: int
    KV: int
    H: int
    C: int
    N: int | None
    S: int
    dtype: torch.dtype
    device: torch.device
    planes: tuple[PlaneGeometry, ...] = ()
    #: Format 3: the extent of each split's place whose factor the spec names (`H%g`), as the
    #: tensors have it; a literal factor (`C%8`) is the generated code's own.
    splits: tuple[tuple[str, int], ...] = ()

    def extents(self) -> dict[str, int]:
        ext = {"L": self.L, "KV": self.KV, "H": self.H, "C": self.C, "S": self.S, **dict(self.splits)}
        if self.N is not None:
            ext.update(N=self.N, B=self.S // self.N)
        return ext

    def split(self, place: str) -> int:
        """The factor of a split by a named factor: its place's extent (`g.split('H%g')`)."""
        return dict(self.splits)[place]

    @property
    def head_group(self) -> int:
        """The heads of a group where the tensors split H into groups (`H%g`); 1 otherwise."""
        return next((n for place, n in self.splits if place.startswith("H%")), 1)

    def plane_start(self, index: int) -> int:
        """Where plane `index` starts in a row of every plane (the bytes of the planes before it)."""
        return sum(p.C for p in self.planes[:index])

    @property
    def row_bytes(self) -> int:
        """The bytes of one row holding every plane."""
        return sum(p.C for p in self.planes)


#: A part of a format-2 cache: (name, dims, dtypes).
PartLayout = tuple[str, Dims, tuple[str, ...]]


@dataclass(frozen=True)
class PagedLayout:
    name: str
    lists: tuple[str, ...]
    dims: Dims
    sizes: tuple[tuple[str, int], ...]
    dtypes: tuple[str, ...]
    #: Format 2: the parts under the list level P, in order.
    parts: tuple[PartLayout, ...] = ()
    #: Format 3: the stored slots of one token (`slots_per_token`); the slot mapping holds one
    #: slot per token all the same, the manager's (kvgen.runtime.slots.pooled_slots).
    slots_per_token: int = 1

    def arrow(self, ext: dict[str, int] | None = None) -> str:
        if not self.parts:
            return format_layout(self.lists, self.dims, ext)
        levels = [f"{a}={ext[a]}" if ext and a in ext else a for a in self.lists]
        inner = ", ".join(f"{name} {format_layout((), dims, ext)}" for name, dims, _ in self.parts)
        return " -> ".join([*levels, "{" + inner + "}"])

    def has(self, axis: str) -> bool:
        return axis in self.lists or any(axis in d for d in self.dims)

    @property
    def head_split(self) -> tuple[str, str] | None:
        """(tile, place) where the layout splits H into groups of a size read from its tensors."""
        return head_split(self.dims)


@dataclass(frozen=True)
class ObjectLayout:
    name: str
    format: str
    code: int
    accepts: tuple[str, ...]
    lists: tuple[str, ...]
    dims: Dims
    #: Format 2: "rows" or "regions" (how the planes of a cache are laid out), else None.
    pack: str | None = None

    def arrow(self, ext: dict[str, int] | None = None) -> str:
        if self.pack == "regions":
            region = format_layout((), tuple(d for d in self.dims if d != ("L",)))
            outer = format_layout(self.lists, (("L",), ("R",)) if not self.lists else (("R",),), ext)
            return f"{outer} bytes, per layer each plane as a region {region}"
        text = format_layout(self.lists, self.dims, ext)
        return f"{text} (C: each token's planes, one after another)" if self.pack == "rows" else text


def head_split(dims: Iterable[Sequence[str]]) -> tuple[str, str] | None:
    """(tile, place) where `dims` split H by a factor read from the tensor (`H/g` with `H%g`,
    SGLang's page_unified head groups); None otherwise (a literal factor is a tiling fixed where
    code is generated, not a head group)."""
    axes = {a for d in dims for a in d}
    tile = next((a for a in sorted(axes) if a.startswith("H/") and not a[2:].isdigit()), None)
    if tile is None or f"H%{tile[2:]}" not in axes:
        return None
    return tile, f"H%{tile[2:]}"


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
    if t.is_contiguous():  # the usual object: contiguous strides are never 0 over two elements
        return []
    return [i for i, (n, s) in enumerate(zip(t.shape, t.stride(), strict=True)) if n > 1 and s == 0]


def part_leaves(tree: Any, lists: Sequence[str], part: int) -> list[Any]:
    """The tensors of part `part` of a cache tree, in list order: the level P picks the part (without
    one, every tensor)."""
    level = [tree]
    for axis in lists:
        level = [child for node in level for i, child in enumerate(node) if axis != "P" or i == part]
    return level


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

    def _lengths(self, axis: str, nodes: Sequence[Any]) -> set[int]:
        """The lengths of the lists at level `axis`."""
        for node in nodes:
            if not isinstance(node, (list, tuple)):
                self.fail(f"level {axis} must be a list or tuple, got {type(node).__name__}")
        return {len(node) for node in nodes}

    def _one_length(self, axis: str, found: set[int]) -> int:
        if len(found) != 1 or 0 in found:
            self.fail(f"level {axis} must be non-empty and the same length everywhere, got lengths {sorted(found)}")
        return found.pop()

    def _first_of(self, tensors: Sequence[Any], rank: int, dtypes: Sequence[str] | None, what: str) -> torch.Tensor:
        """The first of tensors that must all be alike: one shape, dtype and device, `rank` dims,
        a dtype of `dtypes` (None: any), real storage and no stride-0 dims. `what` names them
        in a message ("" or "part NAME: ")."""
        for node in tensors:
            if not isinstance(node, torch.Tensor):
                self.fail(f"{what}expected tensors under the list levels, got {type(node).__name__}")
        first = tensors[0]
        for leaf in tensors[1:]:
            if leaf.shape != first.shape or leaf.dtype != first.dtype or leaf.device != first.device:
                self.fail(f"{what}every tensor must have one shape, dtype and device; found {_placed(first)} and "
                          f"{_placed(leaf)}")
        if first.dim() != rank:
            self.fail(f"{what}tensors must have {rank} dims, got {first.dim()} "
                      f"(tensor[{', '.join(map(str, first.shape))}])")
        dtype_name = str(first.dtype).removeprefix("torch.")
        if dtypes is not None and dtype_name not in dtypes:
            self.fail(f"{what}dtype {dtype_name} is not one of {', '.join(dtypes)}")
        if first.device.type == "meta":
            self.fail(f"{what}cache tensors must have storage, got tensors on the meta device")
        for leaf in tensors:
            shared = broadcast_dims(leaf)
            if shared:
                self.fail(f"{what}dims {shared} of a cache tensor have stride 0 (an expanded view), so distinct "
                          "slots would share memory; pass a tensor with its own storage")
        return first

    def leaves(self) -> tuple[tuple[int, ...], torch.Tensor]:
        """The list levels' lengths and the first tensor, after checking that every tensor
        under the levels has one shape, dtype and device, the layout's rank and dtypes,
        real storage and no stride-0 dims."""
        lengths: list[int] = []
        level = [self.kvcaches]
        for axis in self.layout.lists:
            lengths.append(self._one_length(axis, self._lengths(axis, level)))
            level = [child for node in level for child in node]
        return tuple(lengths), self._first_of(level, len(self.layout.dims), self.layout.dtypes, "")

    def _part_tree(self) -> tuple[list[int], list[tuple[Any, int | None]]]:
        """The lengths of the list levels other than P, and every tensor with the part it belongs to."""
        names = [name for name, _, _ in self.layout.parts]
        lengths: list[int] = []
        # Without a level P (one part with fields) every tensor belongs to part 0.
        level: list[tuple[Any, int | None]] = [(self.kvcaches, None if "P" in self.layout.lists else 0)]
        for axis in self.layout.lists:
            found = self._lengths(axis, [node for node, _ in level])
            if axis != "P":
                lengths.append(self._one_length(axis, found))
            elif found != {len(names)}:
                self.fail(f"level P must hold the {len(names)} parts ({', '.join(names)}) everywhere, "
                          f"got lengths {sorted(found)}")
            level = [(child, i if axis == "P" else part) for node, part in level for i, child in enumerate(node)]
        return lengths, level

    def parts(self) -> tuple[tuple[int, ...], tuple[torch.Tensor, ...]]:
        """Format 2: the lengths of the list levels other than P, and the first tensor of
        each part, after checking that the level P holds one entry per part everywhere,
        that every tensor of a part has one shape, dtype and device, the part's rank and
        dtypes, and that all parts share one device."""
        lengths, level = self._part_tree()
        firsts: list[torch.Tensor] = []
        for index, (name, dims, dtypes) in enumerate(self.layout.parts):
            mine = [node for node, part in level if part == index]
            first = self._first_of(mine, len(dims), dtypes or None, f"part {name}: ")  # () allows every dtype
            if firsts and first.device != firsts[0].device:
                self.fail(f"every part must be on one device; found {_placed(firsts[0])} and {_placed(first)}")
            firsts.append(first)
        return tuple(lengths), tuple(firsts)

    def same(self, axis: str, first: int, other: int) -> None:
        """An extent every part shares (L, KV, B, N, H) has one value."""
        if first != other:
            self.fail(f"parts disagree on {axis}: {first} and {other}")

    def byte_rows(self, part: int, block: bool = False, run: int = 0) -> None:
        """Every tensor of a part can be read as bytes: its last dim is contiguous (and, for
        fields inside a block, the block's N x C elements are one run; format 3: its last `run`
        dims are one run)."""
        name = self.layout.parts[part][0] if self.layout.parts else self.layout.name
        for leaf in part_leaves(self.kvcaches, self.layout.lists, part):
            if run and not _dense_tail(leaf, run):
                self.fail(f"part {name}: each block's last {run} dims must be one contiguous run (fields fill "
                          f"its bytes); got shape {list(leaf.shape)}, strides {list(leaf.stride())}")
            if leaf.dim() and leaf.shape[-1] > 1 and leaf.stride(-1) != 1:
                self.fail(f"part {name}: the last dim of every tensor must be contiguous (stride 1) so its rows "
                          f"move as bytes; got strides {list(leaf.stride())}")
            if block and leaf.shape[-2] > 1 and leaf.stride(-2) != leaf.shape[-1] * leaf.stride(-1):
                self.fail(f"part {name}: each block's N x C elements must be one contiguous run (fields fill "
                          f"the block's bytes); got strides {list(leaf.stride())}")

    def word(self, part: int, offset: int, nbytes: int, keep_last: bool = False) -> int:
        """The widest word every tensor of a part allows for a plane of `nbytes` per row at
        byte `offset` (kvgen.runtime.planes.leaf_word)."""
        return min(leaf_word(t, offset, nbytes, keep_last) for t in part_leaves(self.kvcaches, self.layout.lists, part))

    def singleton(self, index: int, extent: int) -> None:
        """A dim the layout writes as 1 has extent 1 (hicache_page_unified's head groups: one)."""
        if extent != 1:
            self.fail(f"dim {index} is a singleton (1) in this layout, got extent {extent}")

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


def _dense_tail(t: torch.Tensor, run: int) -> bool:
    """Whether the last `run` dims of `t` are dense (row-major, stride 1 at the end)."""
    want = 1
    for d in range(t.dim() - 1, t.dim() - 1 - run, -1):
        if t.shape[d] > 1 and t.stride(d) != want:
            return False
        want *= t.shape[d]
    return True
