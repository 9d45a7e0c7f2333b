"""The reference for model connectors: a whole model's cache (groups and state) to and from one
groups object per chunk, worked out here from the specs alone (never the planner or
generated code).

The object is bytes. Its sections, in order: each carried group (model order) as the group's
member object for the chunk, then each carried state group (model order), each of its layers
ascending, each tensor in order: the request's row of that state tensor. Each section starts
at a multiple of 16 bytes; the total is rounded up to 16. A group's member is the first of
the object's members that the build pairs with the group's layout (`available`). A group's
section is filled by the existing reference of (layout, member): kvgen.oracle.reference for
caches of one tensor tree, kvgen.oracle.planes for format-2 caches.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvgen.oracle import planes, reference
from kvgen.oracle.address import region_layout
from kvgen.runtime.ops import bits
from kvgen.spec.library import Library
from kvgen.spec.model import ITEMSIZE, Spec
from kvgen.spec.models import ModelSpec

ALIGN = 16


@dataclass(frozen=True)
class GroupCase:
    """One carried group as the reference sees it: its layout, member object and test extents."""

    name: str
    layers: tuple[int, ...]
    paged: Spec
    member: Spec
    #: Extents of the group's cache (L = its layer count), as kvgen.oracle.reference takes them.
    ext: Mapping[str, int]


@dataclass(frozen=True)
class StateCase:
    name: str
    layers: tuple[int, ...]
    #: (tensor name, shape at this rank) per tensor.
    tensors: tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class ModelCase:
    """A model and a groups object, with the reference's choice of members and extents."""

    model: ModelSpec
    obj: Spec
    groups: tuple[GroupCase, ...]
    states: tuple[StateCase, ...]
    tp: int


def _carried(which: Any, names: tuple[str, ...]) -> tuple[str, ...]:
    if which == "all":
        return names
    return () if which == "none" else tuple(n for n in names if n in which)


#: Extents the reference's test caches take where a spec leaves them open.
DEFAULT_EXT = {"KV": 2, "H": 2, "C": 4, "N": 4, "B": 6}


def model_case(library: Library, model: ModelSpec, obj: Spec, available: Collection[tuple[str, str]],
               tp: int = 1, blocks: int = 6, block_size: int | None = None) -> ModelCase:
    """The reference's view of (model, object): members by the first-member rule, each group's
    extents from the layout's fixed sizes and the model's declared ones (H / tp)."""
    assert obj.carries is not None
    groups = []
    for g in model.groups:
        if g.name not in _carried(obj.carries.groups, model.group_names):
            continue
        paged = library[g.layout]
        member = next(library[m] for m in obj.members if (paged.name, library[m].name) in available)
        ext = {**DEFAULT_EXT, "B": blocks, **dict(paged.sizes)}
        if block_size is not None and "N" not in dict(paged.sizes):
            ext["N"] = block_size
        for key, value in g.sizes:
            ext[key] = value // tp if key == "H" else value
        ext["L"] = len(g.layers)
        if not paged.is_simple:
            ext = planes.parts_extents(paged, ext)
        groups.append(GroupCase(g.name, g.layers, paged, member, ext))
    states = []
    for s in model.states:
        if s.name in _carried(obj.carries.state, model.state_names):
            states.append(StateCase(s.name, s.layers, tuple((t.name, t.rank_shape(tp)) for t in s.tensors)))
    return ModelCase(model, obj, tuple(groups), tuple(states), tp)


def group_cache(case: ModelCase, g: GroupCase, kvcaches: Sequence[Any]) -> list[Any]:
    """The group's entries of the cache list: a cache of its layout with L = its layer count."""
    return [kvcaches[i] for i in g.layers]


def member_object(g: GroupCase, cache: Any, num_tokens: int) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of the group's member object for a chunk."""
    ext = {**g.ext, "T": num_tokens}
    if g.member.pack == "regions":
        sizes = planes.value_sizes(g.paged, cache)
        return (ext["L"], region_layout(g.paged, g.member, ext, sizes, num_tokens)[1]), torch.uint8
    if g.member.pack is not None or not g.paged.is_simple:
        raise NotImplementedError(f"reference: member {g.member.name} of a {g.paged.name} group")
    first = cache
    while not isinstance(first, torch.Tensor):
        first = first[0]
    return reference.leaf_shape(g.member, ext), first.dtype


def sections(case: ModelCase, kvcaches: Sequence[Any], num_tokens: int) -> tuple[list[tuple[str, int, int]], int]:
    """(name, offset, nbytes) of every section, and the object's total bytes."""
    out, at = [], 0

    def place(name: str, nbytes: int) -> None:
        nonlocal at
        out.append((name, at, nbytes))
        at += nbytes
        at = (at + ALIGN - 1) // ALIGN * ALIGN

    for g in case.groups:
        shape, dtype = member_object(g, group_cache(case, g, kvcaches), num_tokens)
        n = dtype.itemsize
        for d in shape:
            n *= d
        place(g.name, n)
    for s in case.states:
        for layer in s.layers:
            for j, (name, shape) in enumerate(s.tensors):
                n = ITEMSIZE[str(kvcaches[layer][j].dtype).removeprefix("torch.")]
                for d in shape:
                    n *= d
                place(f"{s.name}[{layer}].{name}", n)
    return out, at


def _move_group(g: GroupCase, cache: list[Any], section: torch.Tensor, mapping: Sequence[int], start: int, end: int,
                offset: int, skip: int, shape: tuple[int, ...], dtype: torch.dtype, *, to_cache: bool) -> None:
    work = section.clone().view(dtype).view(shape)  # a private typed copy of the section's bytes
    if g.paged.is_simple:
        move = reference.load if to_cache else reference.store
        args = (g.paged, g.member, g.ext, cache, work, mapping, start, end, offset)
    else:
        move = planes.load if to_cache else planes.store
        args = (g.paged, g.member, g.ext, cache, work, mapping, start, end, offset)
    if to_cache:
        move(*args, skip)  # type: ignore[operator]
    else:
        move(*args)  # type: ignore[operator]
        section.copy_(bits(work).reshape(-1).view(torch.uint8))


def store(case: ModelCase, kvcaches: Sequence[Any], obj: torch.Tensor, mappings: Mapping[str, Sequence[int]],
          start: int, end: int, offset: int = 0, state_slot: int | None = None) -> None:
    """Fill the chunk [start, end)'s object (bytes) from the cache, and the state at `state_slot`."""
    _run(case, kvcaches, obj, mappings, start, end, offset, 0, state_slot, to_cache=False)


def load(case: ModelCase, kvcaches: Sequence[Any], obj: torch.Tensor, mappings: Mapping[str, Sequence[int]],
         start: int, end: int, offset: int = 0, skip: int = 0, state_slot: int | None = None) -> None:
    """Write the chunk's object into the cache at each group's slots, and its state into `state_slot`."""
    _run(case, kvcaches, obj, mappings, start, end, offset, skip, state_slot, to_cache=True)


def _run(case: ModelCase, kvcaches: Sequence[Any], obj: torch.Tensor, mappings: Mapping[str, Sequence[int]],
         start: int, end: int, offset: int, skip: int, state_slot: int | None, *, to_cache: bool) -> None:
    placed, total = sections(case, kvcaches, end - start)
    assert obj.dtype == torch.uint8 and tuple(obj.shape) == (total,), (tuple(obj.shape), total)
    where = {name: (at, n) for name, at, n in placed}
    for g in case.groups:
        at, n = where[g.name]
        cache = group_cache(case, g, kvcaches)
        shape, dtype = member_object(g, cache, end - start)
        _move_group(g, cache, obj[at:at + n], [int(s) for s in mappings[g.name]], start, end, offset, skip,
                    shape, dtype, to_cache=to_cache)
    if state_slot is None:
        return
    for s in case.states:
        for layer in s.layers:
            for j, (name, _) in enumerate(s.tensors):
                at, n = where[f"{s.name}[{layer}].{name}"]
                row = bits(kvcaches[layer][j][state_slot])
                if to_cache:
                    raw = obj[at:at + n].clone()
                    row.copy_(raw.view(row.dtype).view(row.shape))
                else:
                    obj[at:at + n].copy_(row.contiguous().reshape(-1).view(torch.uint8))
