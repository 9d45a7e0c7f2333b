"""The reference of the planes kind (spec format 2: a cache of several parts or fields and a
packed object): byte by byte.

Every cache tensor and every object tensor is read as its bytes in index order (row-major
over its shape, whatever its strides); each value of each plane (a part, or a field of a
part) is moved from the address kvgen.oracle.address says for the cache to the one it says
for the object, or back. A plane without a slot axis (a per-layer scale) moves with every
chunk that moves at least one token. Like the layouts reference it reads specs only, never
the planner or generated code, and works out the addresses of every row of a plane at once,
on index grids, then moves the rows' bytes as one gather and scatter.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvgen.oracle.address import ByteAddress, ObjectAddresses, part_width, plane_address, plane_count
from kvgen.oracle.reference.common import Span, flat_index, gather, leaf, one_thread, put_last, tokens
from kvgen.runtime.ops import bits
from kvgen.spec.elements import split_extents, tiled
from kvgen.spec.model import ITEMSIZE, PART_LEVEL, Part, Plane, Spec

Extents = Mapping[str, int]


@dataclass
class Leaf:
    """One tensor's bytes in index order, to read and write, and where it came from."""

    tensor: torch.Tensor
    data: bytearray
    shape: tuple[int, ...]
    item: int

    def offset(self, index: tuple[int, ...], byte: int) -> int:
        flat = 0
        for i, n in zip(index, self.shape, strict=True):
            flat = flat * n + i
        return flat * self.item + byte

    def write_back(self) -> None:
        raw = torch.frombuffer(self.data, dtype=torch.uint8) if self.data else torch.empty(0, dtype=torch.uint8)
        target = bits(self.tensor)
        target.copy_(raw.view(target.dtype).reshape(self.shape).to(target.device))


def read_leaf(t: torch.Tensor) -> Leaf:
    raw = bits(t).detach().cpu().contiguous().reshape(-1)
    data = bytearray(raw.view(torch.uint8).numpy().tobytes()) if raw.numel() else bytearray()
    return Leaf(t, data, tuple(t.shape), t.element_size())


# -- containers and shapes ----------------------------------------------------------------------

def part_shape(spec: Spec, part: Part, ext: Extents) -> tuple[int, ...]:
    pext = {**ext, "C": part_width(spec, part, ext)}
    pext.update(split_extents(part.tensor_axes, pext))
    return tuple(_product(pext[a] for a in d.axes) for d in part.dims)


def _product(values: Any) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def nest_parts(spec: Spec, ext: Extents, make: Callable[[tuple[int, ...], Part], Any]) -> Any:
    """Containers as engines hand them over: lists per layer, tuples for (K, V) and for the
    parts of the level P. `make(path, part)` makes each leaf."""

    def level(depth: int, path: tuple[int, ...]) -> Any:
        if depth == len(spec.lists):
            index = path[spec.lists.index(PART_LEVEL)] if PART_LEVEL in spec.lists else 0
            return make(path, spec.parts[index])
        axis = spec.lists[depth]
        size = len(spec.parts) if axis == PART_LEVEL else ext[axis]
        items = [level(depth + 1, (*path, i)) for i in range(size)]
        return tuple(items) if axis in ("KV", PART_LEVEL) else items

    return level(0, ())


def cache_paths(spec: Spec, ext: Extents) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(len(spec.parts) if a == PART_LEVEL else ext[a]) for a in spec.lists)))


def object_paths(obj: Spec, ext: Extents) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(ext[a]) for a in obj.lists)))


# -- values -----------------------------------------------------------------------------------

def value_sizes(spec: Spec, kvcaches: Any) -> dict[str, int]:
    """Bytes of one value of each plane: its field's dtype, else its part's tensors'."""
    items = _storage_items(spec, kvcaches)
    return {p.name: (p.field.itemsize if p.field is not None else items[p.part.name]) for p in spec.moved_planes()}


def value_rows(plane: Plane, ext: Extents) -> Iterator[dict[str, int]]:
    """Every (l, kv, h) of one plane: each holds a row of values c = 0 .. count - 1."""
    ranges = {a.lower(): range(ext[a] if a in plane.axes else 1) for a in ("L", "KV", "H")}
    for combo in itertools.product(*ranges.values()):
        yield dict(zip(ranges, combo, strict=True))


def _storage_items(spec: Spec, kvcaches: Any) -> dict[str, int]:
    """Bytes per element of each part's tensors."""
    out = {}
    for path in cache_paths(spec, {a: 1 for a in spec.lists if a != PART_LEVEL}):
        part = spec.parts[path[spec.lists.index(PART_LEVEL)]] if PART_LEVEL in spec.lists else spec.parts[0]
        out[part.name] = leaf(kvcaches, path).element_size()
    return out


def store(paged: Spec, obj: Spec, ext: Extents, kvcaches: Any, objects: Any, span: Span) -> None:
    """Copy the span's tokens of a format-2 cache into `objects` (one tensor, or a per-layer list)."""
    chunk = _chunk(paged, obj, ext, kvcaches, objects, replace(span, skip=0))
    if chunk is not None:
        _move(chunk, to_cache=False)


def load(paged: Spec, obj: Spec, ext: Extents, kvcaches: Any, objects: Any, span: Span) -> None:
    """Copy `objects` into a format-2 cache at the span's slots (its first `skip` tokens left alone)."""
    chunk = _chunk(paged, obj, ext, kvcaches, objects, span)
    if chunk is not None:
        _move(chunk, to_cache=True)


@dataclass(frozen=True)
class _PlanesChunk:
    """One chunk's move between a format-2 cache and its objects: both as bytes, the tokens
    moved (position in the chunk, slot), and what gives each plane's addresses on each side."""

    paged: Spec
    ext: Extents
    moved: list[tuple[int, int]]
    cache: Bytes
    objs: Bytes
    #: The objects' list sizes ([] for one tensor), to number a per-layer object's tensors.
    obj_sizes: list[int]
    sizes: dict[str, int]
    items: dict[str, int]
    there_of: Callable[..., ByteAddress]


def _chunk(paged: Spec, obj: Spec, ext: Extents, kvcaches: Any, objects: Any, span: Span) -> _PlanesChunk | None:
    """The chunk's bytes and addresses, or None when it moves no token."""
    moved = list(tokens([int(s) for s in span.slot_mapping], span.start, span.end, span.offset, span.skip))
    if not moved:
        return None
    obj_ext = {**ext, "T": span.end - span.start}
    one = isinstance(objects, torch.Tensor)
    objs = Bytes([objects] if one else [leaf(objects, p) for p in object_paths(obj, obj_ext)])
    sizes = value_sizes(paged, kvcaches)
    return _PlanesChunk(paged, ext, moved, Bytes([leaf(kvcaches, p) for p in cache_paths(paged, ext)]), objs,
                  [] if one else [ext[a] for a in obj.lists], sizes, _storage_items(paged, kvcaches),
                  ObjectAddresses(paged, obj, obj_ext, sizes, objs.items[0]).address)


@one_thread
def _move(chunk: _PlanesChunk, *, to_cache: bool) -> None:
    """Store (to_cache False) or load every plane of the chunk, then write the changed side back."""
    cache, objs = chunk.cache, chunk.objs
    for plane in chunk.paged.moved_planes():
        a, b = _plane_bytes(chunk, plane)
        if to_cache:
            put_last(cache.data, a, gather(objs.data, b))
        else:  # each object byte is one token's, once: a plain scatter
            objs.data.index_copy_(0, b.reshape(-1), gather(cache.data, a))
    (cache if to_cache else objs).write_back()


def _plane_bytes(chunk: _PlanesChunk, plane: Plane) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes of one plane's moved values: their places in the cache's and in the objects' bytes."""
    paged, ext = chunk.paged, chunk.ext
    item, size, count = chunk.items[plane.part.name], chunk.sizes[plane.name], plane_count(paged, plane, ext)
    t, slot = (torch.tensor(v).view(-1, 1, 1, 1) for v in zip(*chunk.moved, strict=True)) if plane.has_slots \
        else (torch.zeros(1, 1, 1, 1, dtype=torch.long),) * 2
    rows = _value_grids(plane, ext)
    if tiled(plane.part.tensor_axes):  # a split axis: a row's values lie apart, so each value is placed alone
        return _value_bytes(chunk, plane, (t, slot, rows), count, size)
    # A row's values follow one another in both tensors' bytes (C is innermost and moves as
    # bytes): the address of its first and last value says where it lies.
    here = [chunk.cache.offsets(plane_address(paged, plane, {**rows, "slot": slot, "c": c}, ext, item),
                                _list_sizes(paged, ext)) for c in (0, count - 1)]
    there = [chunk.objs.offsets(chunk.there_of(plane, {**rows, "t": t, "c": c}), chunk.obj_sizes)
             for c in (0, count - 1)]
    a, b = _runs(plane, here, count, size), _runs(plane, there, count, size)
    step = torch.arange(count * size)
    a, b = (torch.broadcast_to(x, torch.broadcast_shapes(a.shape, b.shape)).reshape(-1, 1) + step for x in (a, b))
    return a, b


def _value_bytes(chunk: _PlanesChunk, plane: Plane, grids: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]],
                 count: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """_plane_bytes for a plane with split axes (format 3 tiles): every value's address on both
    sides, each value c = 0 .. count - 1 on an index grid of its own, innermost."""
    paged, ext = chunk.paged, chunk.ext
    t, slot = (g.unsqueeze(-1) for g in grids[:2])
    rows = {k: g.unsqueeze(-1) for k, g in grids[2].items()}
    c = torch.arange(count).view(1, 1, 1, 1, -1)
    item = chunk.items[plane.part.name]
    _, a = chunk.cache.offsets(plane_address(paged, plane, {**rows, "slot": slot, "c": c}, ext, item),
                               _list_sizes(paged, ext))
    _, b = chunk.objs.offsets(chunk.there_of(plane, {**rows, "t": t, "c": c}), chunk.obj_sizes)
    step = torch.arange(size)
    a, b = (torch.broadcast_to(x, torch.broadcast_shapes(a.shape, b.shape)).reshape(-1, 1) + step for x in (a, b))
    return a, b


class Bytes:
    """The bytes of some tensors, each in index order, laid end to end, with where each starts."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.items = [t.element_size() for t in tensors]
        self.shapes = [tuple(t.shape) for t in tensors]
        raw = [bits(t).detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
        self.starts = [0]
        for r in raw:
            self.starts.append(self.starts[-1] + r.numel())
        self.data = torch.cat(raw) if raw else torch.empty(0, dtype=torch.uint8)

    def offsets(self, address: ByteAddress, list_sizes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(tensor number, byte in the whole) of a ByteAddress of index grids (and ints); tensors
        are numbered in path order over `list_sizes`, and those reached must share a shape."""
        path, index, byte = address
        number = flat_index(path, list_sizes, "a value's tensor number")
        numbers = number.unique().tolist() if isinstance(number, torch.Tensor) else [number]
        reached = {self.shapes[k] for k in numbers}
        if len(reached) != 1:
            raise AssertionError(f"one plane's values lie in tensors of shapes {sorted(reached)}")
        shape, item = reached.pop(), self.items[numbers[0]]
        flat = flat_index(index, shape, "a value address")
        start = torch.tensor(self.starts)[number] if isinstance(number, torch.Tensor) else self.starts[number]
        return torch.as_tensor(number), torch.as_tensor(start + flat * item + byte)

    def write_back(self) -> None:
        for t, lo, hi, shape in zip(self.tensors, self.starts[:-1], self.starts[1:], self.shapes, strict=True):
            target = bits(t)
            raw = self.data[lo:hi]
            if raw.storage_offset() % target.element_size():  # a view as wider words needs them aligned
                raw = raw.clone()
            target.copy_(raw.view(target.dtype).reshape(shape).to(target.device))


def _list_sizes(spec: Spec, ext: Extents) -> list[int]:
    return [len(spec.parts) if a == PART_LEVEL else ext[a] for a in spec.lists]


def _value_grids(plane: Plane, ext: Extents) -> dict[str, torch.Tensor]:
    """Every (l, kv, h) of one plane as index grids over (token, L, KV, H)."""
    out = {}
    for i, a in enumerate(("L", "KV", "H")):
        n = ext[a] if a in plane.axes else 1
        out[a.lower()] = torch.arange(n).view([1] + [n if k == i else 1 for k in range(3)])
    return out


def _runs(plane: Plane, ends: list[tuple[torch.Tensor, torch.Tensor]], count: int, size: int) -> torch.Tensor:
    """The first byte of each row of `count` values of `size` bytes, from (tensor, byte) of its
    first and last value, checking that the last lies (count - 1) values after the first."""
    (first_t, first), (last_t, last) = (torch.broadcast_tensors(*e) for e in ends)
    if not (torch.equal(first_t, last_t) and torch.equal(last - first, torch.full_like(first, (count - 1) * size))):
        raise AssertionError(f"{plane.name}: values of one row are not consecutive bytes")
    return first


# -- test data --------------------------------------------------------------------------------

def code_bytes(label: str, count: int) -> torch.Tensor:
    """`count` bytes (uint8) that depend on `label` and on each byte's position: a misplaced byte
    run differs from the one expected except by chance (2**-8 per byte). They are torch's CPU
    generator's bytes from a seed hashed from `label`: one call however large the cache, drawn as
    64-bit words (a quarter of the time of drawing each byte)."""
    seed = int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "little")
    words = torch.randint(-2**63, 2**63 - 1, (-(-count // 8),), dtype=torch.int64,
                          generator=torch.Generator().manual_seed(seed))
    return words.view(torch.uint8)[:count]


def fill_bytes(t: torch.Tensor, label: str) -> None:
    """Every byte of `t` (in index order) gets a code of `label` and its position."""
    target = bits(t)
    codes = code_bytes(label, t.numel() * t.element_size())
    target.copy_(codes.view(target.dtype).reshape(t.shape).to(target.device))


def storage_dtype(part: Part, default: str) -> str:
    """The dtype a part's tensors are made with in tests: its only one, else `default`
    when allowed, else its first."""
    return default if default in part.dtypes else part.dtypes[0]


__all__ = ["ITEMSIZE", "load", "nest_parts", "part_shape", "store", "fill_bytes", "read_leaf", "storage_dtype",
           "make_parts_cache", "copy_parts_cache"]


def parts_extents(spec: Spec, ext: Extents) -> dict[str, int]:
    """Test extents for a format-2 cache: each part of free width gets its own C
    (ext["C"] + 2 * its index), so planes of one cache differ in width; the extents the spec
    fixes (one head slot, say) hold."""
    out = {**ext, **dict(spec.sizes)}
    for i, part in enumerate(spec.parts):
        out.setdefault(f"C.{part.name}", ext["C"] + 2 * i)
    return out


def allocate_part(shape: tuple[int, ...], dtype: torch.dtype, device: str, strided: bool, odd_offset: bool,
                  tail: int) -> torch.Tensor:
    """A zeroed tensor of `shape`; strided: a view into a larger buffer with the leading
    dims permuted and a storage offset, the last `tail` dims kept contiguous (rows move as
    bytes); odd_offset: contiguous, one element into its storage."""
    n = _product(shape)
    if odd_offset:
        return torch.zeros(n + 1, dtype=dtype, device=device)[1:].view(shape)
    if not strided or len(shape) - tail < 2:
        return torch.zeros(shape, dtype=dtype, device=device)
    lead, rest = list(shape[:len(shape) - tail]), list(shape[len(shape) - tail:])
    order = list(reversed(range(len(lead))))
    big = torch.zeros([lead[order[0]] + 1, *(lead[i] for i in order[1:]), *rest], dtype=dtype, device=device)[1:]
    inverse = [order.index(i) for i in range(len(lead))]
    return big.permute(*inverse, *range(len(lead), len(shape)))


def tail_dims(part: Part) -> int:
    """Trailing dims a part's tensors keep contiguous: the row (and, for block fields, the
    dims after B)."""
    if not part.has("C"):
        return 0
    return len(part.block_run) if part.fields_in == "block" else 1


def make_parts_cache(spec: Spec, ext: Extents, dtype: torch.dtype, device: str) -> Any:
    """A format-2 cache whose every byte carries a code of its part, leaf and position; each part's
    tensors of `dtype` where it may hold it, else of its first dtype."""
    default = str(dtype).removeprefix("torch.")

    def make(path: tuple[int, ...], part: Part) -> torch.Tensor:
        t = torch.zeros(part_shape(spec, part, ext), dtype=getattr(torch, storage_dtype(part, default)), device=device)
        fill_bytes(t, f"{spec.name}/{part.name}/{path}")
        return t

    return nest_parts(spec, ext, make)


def copy_parts_cache(spec: Spec, ext: Extents, template: Any, device: str, strided: bool = False,
                     odd_offset: bool = False) -> Any:
    """A copy of the format-2 cache `template` (of extents `ext`) in fresh tensors on `device`,
    allocated as allocate_part says (strided, odd_offset)."""

    def make(path: tuple[int, ...], part: Part) -> torch.Tensor:
        like = leaf(template, path)
        t = allocate_part(tuple(like.shape), like.dtype, device, strided, odd_offset, tail_dims(part))
        bits(t).copy_(bits(like))
        return t

    return nest_parts(spec, ext, make)
