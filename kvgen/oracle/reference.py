"""The reference interpreter: a slow, obviously correct store and load, element by element.

It reads the specs through `kvgen.oracle.address` only (never the planner or generated code),
works on plain Python lists of the tensors' bits, and so says what any connector must
produce. Tests and `kvgen verify` compare every generated connector with it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from kvgen.oracle.address import element_address
from kvgen.runtime.ops import bits
from kvgen.spec.model import Spec

Extents = Mapping[str, int]


def leaf_shape(spec: Spec, ext: Extents) -> tuple[int, ...]:
    shape = []
    for dim in spec.dims:
        size = 1
        for axis in dim.axes:
            size *= ext[axis]
        shape.append(size)
    return tuple(shape)


def leaf_paths(spec: Spec, ext: Extents) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(ext[a]) for a in spec.lists)))


def nest(spec: Spec, ext: Extents, make: Any) -> Any:
    """Containers as engines hand them over: a list per layer, a tuple for (K, V)."""

    def level(depth: int, path: tuple[int, ...]) -> Any:
        if depth == len(spec.lists):
            return make(path)
        axis = spec.lists[depth]
        items = [level(depth + 1, (*path, i)) for i in range(ext[axis])]
        return tuple(items) if axis == "KV" else items

    return level(0, ())


def leaf(tree: Any, path: Sequence[int]) -> torch.Tensor:
    for i in path:
        tree = tree[i]
    return tree


def _logical(spec: Spec, ext: Extents) -> Iterator[dict[str, int]]:
    ranges = {a.lower(): range(ext[a] if spec.has(a) else 1) for a in ("L", "KV", "H", "C")}
    for values in itertools.product(*ranges.values()):
        yield dict(zip(ranges, values, strict=False))


def _read(tree: Any, spec: Spec, paths: list[tuple[int, ...]]) -> dict[tuple[int, ...], Any]:
    return {p: bits(leaf(tree, p)).tolist() for p in paths}


def _write_back(tree: Any, values: dict[tuple[int, ...], Any]) -> None:
    for path, nested in values.items():
        target = leaf(tree, path)
        raw = bits(target)
        raw.copy_(torch.tensor(nested, dtype=raw.dtype, device=raw.device))


def _get(nested: Any, index: tuple[int, ...]) -> Any:
    for i in index[:-1]:
        nested = nested[i]
    return nested, index[-1]


def tokens(slot_mapping: Sequence[int], start: int, end: int, offset: int = 0,
           skip: int = 0) -> Iterator[tuple[int, int]]:
    """(position in chunk, slot) of every token a transfer moves."""
    for i in range(start + skip, end):
        slot = int(slot_mapping[i - offset])
        if slot >= 0:
            yield i - start, slot


def store(paged: Spec, obj: Spec, ext: Extents, kvcaches: Any, objects: Any, slot_mapping: Sequence[int],
          start: int, end: int, offset: int = 0) -> None:
    """Copy tokens [start, end) from the cache into `objects` (one tensor, or a per-layer list)."""
    _move(paged, obj, ext, kvcaches, objects, slot_mapping, start, end, offset, 0, to_cache=False)


def load(paged: Spec, obj: Spec, ext: Extents, kvcaches: Any, objects: Any, slot_mapping: Sequence[int],
         start: int, end: int, offset: int = 0, skip: int = 0) -> None:
    """Copy `objects` into the cache at the chunk's slots."""
    _move(paged, obj, ext, kvcaches, objects, slot_mapping, start, end, offset, skip, to_cache=True)


def _move(paged: Spec, obj: Spec, ext: Extents, kvcaches: Any, objects: Any, slot_mapping: Sequence[int],
          start: int, end: int, offset: int, skip: int, *, to_cache: bool) -> None:
    mapping = [int(s) for s in slot_mapping]
    obj_ext = {**ext, "T": end - start}
    cache_vals = _read(kvcaches, paged, leaf_paths(paged, ext))
    obj_vals = _read(objects, obj, leaf_paths(obj, obj_ext))
    for t, slot in tokens(mapping, start, end, offset, skip):
        for coords in _logical(paged, ext):
            cpath, cidx = element_address(paged, {**coords, "slot": slot}, ext)
            opath, oidx = element_address(obj, {**coords, "t": t}, obj_ext)
            c_list, c_last = _get(cache_vals[cpath], cidx)
            o_list, o_last = _get(obj_vals[opath], oidx)
            if to_cache:
                c_list[c_last] = o_list[o_last]
            else:
                o_list[o_last] = c_list[c_last]
    _write_back(kvcaches if to_cache else objects, cache_vals if to_cache else obj_vals)


# -- coordinate-encoding test data ----------------------------------------------------

#: Bit patterns per element width that are finite numbers in every float dtype of that
#: width (so no NaN canonicalisation can hide a difference): exclusive upper bounds.
_CODE_SPACE = {4: 0x3F000000, 2: 0x7B00, 1: 0x7B}


def code_space(dtype: torch.dtype) -> int:
    return _CODE_SPACE[torch.empty(0, dtype=dtype).element_size()]


def coded(ident: int, dtype: torch.dtype) -> int:
    """A distinct, finite bit pattern for `ident` (unique while ident < code_space)."""
    return ident % (code_space(dtype) - 1) + 1


def fill_cache(paged: Spec, ext: Extents, kvcaches: Any, dtype: torch.dtype, salt: int = 0) -> None:
    """Give every element the code of its coordinates (l, kv, slot, h, c)."""
    paths = leaf_paths(paged, ext)
    vals = _read(kvcaches, paged, paths)
    slots = ext["S"] if "S" in ext else ext["B"] * ext["N"]
    kv, h, c = (ext[a] if paged.has(a) else 1 for a in ("KV", "H", "C"))
    for slot in range(slots):
        for coords in _logical(paged, ext):
            ident = (((coords["l"] * kv + coords["kv"]) * slots + slot) * h + coords["h"]) * c + coords["c"]
            path, idx = element_address(paged, {**coords, "slot": slot}, ext)
            lst, last = _get(vals[path], idx)
            lst[last] = coded(ident + salt, dtype)
    _write_back(kvcaches, vals)


def fill_object(tensors: Sequence[torch.Tensor], dtype: torch.dtype, salt: int) -> None:
    """Fill object tensors with position codes distinct from fill_cache's (by `salt`)."""
    base = 0
    for t in tensors:
        n = t.numel()
        codes = [coded(base + i + salt, dtype) for i in range(n)]
        raw = bits(t)
        raw.copy_(torch.tensor(codes, dtype=raw.dtype).view(raw.shape))
        base += n
