"""The reference interpreter for format-2 caches (parts and fields): byte by byte.

Every cache tensor and every object tensor is read as its bytes in index order (row-major
over its shape, whatever its strides); each value of each plane (a part, or a field of a
part) is moved from the address kvgen.oracle.address says for the cache to the one it says
for the object, or back. A plane without a slot axis (a per-layer scale) moves with every
chunk that moves at least one token. Like kvgen.oracle.reference it reads specs only, never
the planner or generated code.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from kvgen.oracle.address import ByteAddress, ObjectAddresses, plane_address, plane_count
from kvgen.oracle.reference import leaf, tokens
from kvgen.runtime.ops import bits
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
    from kvgen.oracle.address import part_width

    pext = {**ext, "C": part_width(spec, part, ext)}
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


def move(paged: Spec, obj: Spec, ext: Extents, kvcaches: Any, objects: Any, slot_mapping: Sequence[int],
         start: int, end: int, offset: int = 0, skip: int = 0, *, to_cache: bool) -> None:
    """Store (to_cache False) or load the chunk [start, end) of a format-2 cache."""
    mapping = [int(s) for s in slot_mapping]
    moved = list(tokens(mapping, start, end, offset, skip))
    obj_ext = {**ext, "T": end - start}
    cache = {p: read_leaf(leaf(kvcaches, p)) for p in cache_paths(paged, ext)}
    if isinstance(objects, torch.Tensor):
        objs = {(): read_leaf(objects)}
    else:
        objs = {p: read_leaf(leaf(objects, p)) for p in object_paths(obj, obj_ext)}
    sizes = value_sizes(paged, kvcaches)
    items = _storage_items(paged, kvcaches)
    there_of = ObjectAddresses(paged, obj, obj_ext, sizes, next(iter(objs.values())).item).address
    for plane in paged.moved_planes():
        item, size, count = items[plane.part.name], sizes[plane.name], plane_count(paged, plane, ext)
        work = moved if plane.has_slots else ([(None, None)] if moved else [])
        for t, slot in work:
            for v in value_rows(plane, ext):
                # A row's values follow one another in both tensors' bytes (C is innermost and
                # moves as bytes): the address of its first and last value says where it lies.
                here = partial(_at_cache, paged, plane, {**v, "slot": slot or 0}, ext, item)
                there = partial(_at_object, there_of, plane, {**v, "t": t or 0})
                c_leaf, a = _run(cache, here, plane, count, size)
                o_leaf, b = _run(objs, there, plane, count, size)
                n = count * size
                if to_cache:
                    c_leaf.data[a:a + n] = o_leaf.data[b:b + n]
                else:
                    o_leaf.data[b:b + n] = c_leaf.data[a:a + n]
    for written in (cache if to_cache else objs).values():
        written.write_back()


def _at_cache(paged: Spec, plane: Plane, coords: dict[str, int], ext: Extents, item: int, c: int) -> ByteAddress:
    return plane_address(paged, plane, {**coords, "c": c}, ext, item)


def _at_object(there_of: Callable[[Plane, dict[str, int]], ByteAddress], plane: Plane, coords: dict[str, int],
               c: int) -> ByteAddress:
    return there_of(plane, {**coords, "c": c})


def _run(leaves: dict[tuple[int, ...], Leaf], at: Callable[[int], ByteAddress], plane: Plane, count: int,
         size: int) -> tuple[Leaf, int]:
    """The leaf and first byte of a row of `count` values of `size` bytes (`at(c)`: where
    value c starts), checking that its last value lies (count - 1) values after the first."""
    first, last = at(0), at(count - 1)
    target = leaves[first[0]]
    a, z = target.offset(first[1], first[2]), target.offset(last[1], last[2])
    if last[0] != first[0] or z - a != (count - 1) * size:
        raise AssertionError(f"{plane.name}: values of one row are not consecutive bytes ({first} .. {last})")
    return target, a


def store(paged: Spec, obj: Spec, ext: Extents, kvcaches: Any, objects: Any, slot_mapping: Sequence[int],
          start: int, end: int, offset: int = 0) -> None:
    move(paged, obj, ext, kvcaches, objects, slot_mapping, start, end, offset, 0, to_cache=False)


def load(paged: Spec, obj: Spec, ext: Extents, kvcaches: Any, objects: Any, slot_mapping: Sequence[int],
         start: int, end: int, offset: int = 0, skip: int = 0) -> None:
    move(paged, obj, ext, kvcaches, objects, slot_mapping, start, end, offset, skip, to_cache=True)


# -- test data --------------------------------------------------------------------------------

def code_bytes(label: str, count: int) -> bytes:
    """`count` bytes that depend on `label` and on each byte's position: a misplaced byte
    run differs from the one expected except by chance (2**-8 per byte)."""
    out = bytearray()
    block = 0
    while len(out) < count:
        out += hashlib.blake2b(f"{label}/{block}".encode(), digest_size=64).digest()
        block += 1
    return bytes(out[:count])


def fill_bytes(t: torch.Tensor, label: str) -> None:
    """Every byte of `t` (in index order) gets a code of `label` and its position."""
    n = t.numel() * t.element_size()
    data = bytearray(code_bytes(label, n))
    Leaf(t, data, tuple(t.shape), t.element_size()).write_back()


def storage_dtype(part: Part, default: str) -> str:
    """The dtype a part's tensors are made with in tests: its only one, else `default`
    when allowed, else its first."""
    return default if default in part.dtypes else part.dtypes[0]


__all__ = ["ITEMSIZE", "load", "nest_parts", "part_shape", "store", "fill_bytes", "read_leaf", "storage_dtype"]


def parts_extents(spec: Spec, ext: Extents) -> dict[str, int]:
    """Test extents for a format-2 cache: each part of free width gets its own C
    (ext["C"] + 2 * its index), so planes of one cache differ in width."""
    out = dict(ext)
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
    """Trailing dims a part's tensors keep contiguous: the row (and, for block fields, the N
    before it)."""
    if not part.has("C"):
        return 0
    return 2 if part.fields_in == "block" else 1


def make_parts_cache(spec: Spec, ext: Extents, dtype: torch.dtype, device: str, strided: bool = False,
                     odd_offset: bool = False, template: Any = None) -> Any:
    """A format-2 cache whose every byte carries a code of its part, leaf and position (or,
    given `template`, a copy of it in fresh tensors)."""
    default = str(dtype).removeprefix("torch.")

    def make(path: tuple[int, ...], part: Part) -> torch.Tensor:
        t = allocate_part(part_shape(spec, part, ext), getattr(torch, storage_dtype(part, default)), device,
                          strided, odd_offset, tail_dims(part))
        if template is None:
            fill_bytes(t, f"{spec.name}/{part.name}/{path}")
        else:
            bits(t).copy_(bits(leaf(template, path)))
        return t

    return nest_parts(spec, ext, make)
