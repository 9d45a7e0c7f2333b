"""The reference of the layouts kind (spec format 1: a cache and an object of one tensor tree
each): an obviously correct store and load, element by element.

Each element moves from where `element_address` puts it in the cache to where it puts it in
the object; the function is evaluated on index grids of every element at once (it is plain
arithmetic), and the elements move as one gather and scatter over the tensors' bits laid end
to end. Also the coordinate-coded caches and objects the tests fill through the same addresses.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvgen.oracle.address import element_address, stored_slots
from kvgen.oracle.reference.common import Span, flat_index, gather, leaf, one_thread, put_last, tokens
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


def logical_grids(spec: Spec, ext: Extents, lead: Sequence[int] = ()) -> dict[str, torch.Tensor]:
    """Every (l, kv, h, c) of `spec` as index grids that broadcast to (*lead, L, KV, H, C), in
    the order of nested loops over l, kv, h, c (an axis the spec lacks has extent 1)."""
    sizes = [ext[a] if spec.has(a) else 1 for a in ("L", "KV", "H", "C")]
    out = {}
    for i, (name, n) in enumerate(zip(("l", "kv", "h", "c"), sizes, strict=True)):
        view = [1] * (len(lead) + len(sizes))
        view[len(lead) + i] = n
        out[name] = torch.arange(n).view(view)
    return out


def element_positions(spec: Spec, coords: Mapping[str, Any], ext: Extents, shape: Sequence[int]) -> torch.Tensor:
    """Where each element at `coords` (index grids) lies in the spec's leaves laid end to end
    in leaf_paths order, each leaf in index order: element_address evaluated on every
    element at once, each index checked against the extent it indexes."""
    path, index = element_address(spec, coords, ext)
    extents = (*(ext[a] for a in spec.lists), *shape)
    return torch.as_tensor(flat_index((*path, *index), extents, f"{spec.name}: an element address"))


def flat_bits(tree: Any, paths: list[tuple[int, ...]]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The bits of every leaf, in index order, laid end to end (on the CPU), and the leaf shape.
    One contiguous CPU leaf is its own flat bits (a view, not a copy: write_back then has
    nothing to do)."""
    shapes = {tuple(leaf(tree, p).shape) for p in paths}
    if len(shapes) != 1:
        raise ValueError(f"leaves of one tree differ in shape: {sorted(shapes)}")
    flats = [bits(leaf(tree, p)).detach().cpu().reshape(-1) for p in paths]
    return (flats[0] if len(flats) == 1 else torch.cat(flats)), shapes.pop()


def write_back(tree: Any, paths: list[tuple[int, ...]], flat: torch.Tensor) -> None:
    at = 0
    for path in paths:
        raw = bits(leaf(tree, path))
        n = raw.numel()
        part = flat[at:at + n]
        if not (raw.is_contiguous() and raw.data_ptr() == part.data_ptr()):  # not a view of this leaf
            raw.copy_(part.view(raw.shape))
        at += n


@dataclass(frozen=True)
class _Matched:
    """The cache's and the objects' values as flat bits, and the positions of the moved elements in each."""

    cache_vals: torch.Tensor
    cache_paths: list[tuple[int, ...]]
    here: torch.Tensor
    obj_vals: torch.Tensor
    obj_paths: list[tuple[int, ...]]
    there: torch.Tensor


def _matched(paged: Spec, obj: Spec, ext: Extents, kvcaches: Any, objects: Any, span: Span) -> _Matched | None:
    """Where each moved element lives in the cache and in the objects; None when no token moves."""
    mapping = [int(s) for s in span.slot_mapping]
    per = paged.token_ratio[1]
    obj_ext = {**ext, "T": (span.end - span.start) * per}
    # A token of k stored slots is k object rows t * k + j, from its slot's k stored slots in order.
    moved = [(t * per + j, stored) for t, slot in tokens(mapping, span.start, span.end, span.offset, span.skip)
             for j, stored in enumerate(stored_slots(paged, slot))]
    if not moved:
        return None
    cache_paths, obj_paths = leaf_paths(paged, ext), leaf_paths(obj, obj_ext)
    cache_vals, cache_shape = flat_bits(kvcaches, cache_paths)
    obj_vals, obj_shape = flat_bits(objects, obj_paths)
    t, slot = (torch.tensor(v).view(-1, 1, 1, 1, 1) for v in zip(*moved, strict=True))
    coords = logical_grids(paged, ext, (len(moved),))
    here = element_positions(paged, {**coords, "slot": slot}, ext, cache_shape)
    there = element_positions(obj, {**coords, "t": t}, obj_ext, obj_shape)
    here, there = torch.broadcast_tensors(here, there)
    return _Matched(cache_vals, cache_paths, here, obj_vals, obj_paths, there)


@one_thread
def store(paged: Spec, obj: Spec, ext: Extents, kvcaches: Any, objects: Any, span: Span) -> None:
    """Copy the span's tokens from the cache into `objects` (one tensor, or a per-layer list)."""
    m = _matched(paged, obj, ext, kvcaches, objects, replace(span, skip=0))
    if m is not None:
        # each object element is one moved token's, once (distinct chunk rows): a plain scatter
        m.obj_vals.index_copy_(0, m.there.reshape(-1), gather(m.cache_vals, m.here).to(m.obj_vals.dtype))
        write_back(objects, m.obj_paths, m.obj_vals)


@one_thread
def load(paged: Spec, obj: Spec, ext: Extents, kvcaches: Any, objects: Any, span: Span) -> None:
    """Copy `objects` into the cache at the span's slots (its first `skip` tokens left alone)."""
    m = _matched(paged, obj, ext, kvcaches, objects, span)
    if m is not None:
        put_last(m.cache_vals, m.here, gather(m.obj_vals, m.there))
        write_back(kvcaches, m.cache_paths, m.cache_vals)


# -- coordinate-encoding test data ----------------------------------------------------

#: Bit patterns per element width that are finite numbers in every float dtype of that
#: width (so no NaN canonicalisation can hide a difference): exclusive upper bounds.
_CODE_SPACE = {4: 0x3F000000, 2: 0x7B00, 1: 0x7B}


def code_space(dtype: torch.dtype) -> int:
    return _CODE_SPACE[torch.empty(0, dtype=dtype).element_size()]


def coded(ident: Any, dtype: torch.dtype) -> Any:
    """A distinct, finite bit pattern for `ident` (unique while ident < code_space); an int,
    or a tensor of them for a tensor of idents."""
    return ident % (code_space(dtype) - 1) + 1


@one_thread
def fill_cache(paged: Spec, ext: Extents, kvcaches: Any, dtype: torch.dtype, salt: int = 0) -> None:
    """Give every element the code of its coordinates (l, kv, slot, h, c)."""
    paths = leaf_paths(paged, ext)
    vals, shape = flat_bits(kvcaches, paths)
    slots = ext["S"] if "S" in ext else ext["B"] * ext["N"]
    kv, h, c = (ext[a] if paged.has(a) else 1 for a in ("KV", "H", "C"))
    coords = logical_grids(paged, ext, (slots,))
    slot = torch.arange(slots).view(-1, 1, 1, 1, 1)
    ident = (((coords["l"] * kv + coords["kv"]) * slots + slot) * h + coords["h"]) * c + coords["c"]
    where, codes = torch.broadcast_tensors(element_positions(paged, {**coords, "slot": slot}, ext, shape),
                                           coded(ident + salt, dtype))
    put_last(vals, where, codes)
    write_back(kvcaches, paths, vals)


def fill_object(tensors: Sequence[torch.Tensor], dtype: torch.dtype, salt: int) -> None:
    """Fill object tensors with position codes distinct from fill_cache's (by `salt`)."""
    base = 0
    for t in tensors:
        n = t.numel()
        raw = bits(t)
        raw.copy_(coded(torch.arange(base + salt, base + salt + n), dtype).to(raw.dtype).view(raw.shape))
        base += n
