"""The reference for model connectors: a whole model's cache (groups and state) to and from one
groups object per chunk, worked out here from the specs alone (never the planner or
generated code).

The object is bytes. Its sections, in order: each carried group (model order) as the group's
member object for the chunk, then each carried state group (model order), each of its layers
ascending, each tensor in order: the request's row of that state tensor. Each section starts
at a multiple of 16 bytes; the total is rounded up to 16. A group's member is the first of
the object's members that the build pairs with the group's layout (`available`). A group's
section is filled by the reference of (layout, member), kvgen.oracle.reference, which picks the
module of the pair's kind (layouts: one tensor tree; planes: a format-2 cache).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvgen.oracle import reference
from kvgen.oracle.address import region_layout
from kvgen.oracle.reference import planes
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
    #: Tokens per stored slot: the group's chunk is tokens [start / k, end / k) of its own slots.
    tokens_per_slot: int = 1


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


@dataclass(frozen=True)
class CaseSizes:
    """The extents a reference case takes where the specs leave them open."""

    tp: int = 1  # the tensor-parallel size: each rank holds H / tp heads
    blocks: int = 6
    block_size: int | None = None  # N where the layout does not fix it (else DEFAULT_EXT's)


def _group_ext(paged: Spec, declared: Sequence[tuple[str, int]], layers: int, sizes: CaseSizes) -> dict[str, int]:
    """A group's cache extents: the layout's fixed sizes, the model's declared ones (H / tp), the case's sizes."""
    ext = {**DEFAULT_EXT, "B": sizes.blocks, **dict(paged.sizes)}
    if sizes.block_size is not None and "N" not in dict(paged.sizes):
        ext["N"] = sizes.block_size
    for key, value in declared:
        ext[key] = value // sizes.tp if key == "H" else value
    ext["L"] = layers
    return ext if paged.is_simple else planes.parts_extents(paged, ext)


def model_case(library: Library, model: ModelSpec, obj: Spec, available: Collection[tuple[str, str]],
               sizes: CaseSizes = CaseSizes()) -> ModelCase:
    """The reference's view of (model, object): members by the first-member rule, each group's
    extents from the layout's fixed sizes and the model's declared ones (H / tp)."""
    assert obj.carries is not None
    groups = []
    for g in model.groups:
        if g.name not in _carried(obj.carries.groups, model.group_names):
            continue
        paged = library[g.layout]
        member = next(library[m] for m in obj.members if (paged.name, library[m].name) in available)
        groups.append(GroupCase(g.name, g.layers, paged, member, _group_ext(paged, g.sizes, len(g.layers), sizes),
                                g.tokens_per_slot))
    states = [StateCase(s.name, s.layers, tuple((t.name, t.rank_shape(sizes.tp)) for t in s.tensors))
              for s in model.states if s.name in _carried(obj.carries.state, model.state_names)]
    return ModelCase(model, obj, tuple(groups), tuple(states), sizes.tp)


def group_cache(case: ModelCase, g: GroupCase, kvcaches: Sequence[Any]) -> list[Any]:
    """The group's entries of the cache list: a cache of its layout with L = its layer count."""
    return [kvcaches[i] for i in g.layers]


def member_object(g: GroupCase, cache: Any, num_tokens: int) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of the group's member object for a chunk of `num_tokens` tokens (one row per stored slot)."""
    assert num_tokens % g.tokens_per_slot == 0, (g.name, num_tokens, g.tokens_per_slot)
    num_tokens //= g.tokens_per_slot
    ext = {**g.ext, "T": num_tokens}
    if g.member.pack == "regions":
        sizes = planes.value_sizes(g.paged, cache)
        return (ext["L"], region_layout(g.paged, g.member, ext, sizes, num_tokens)[1]), torch.uint8
    if g.member.pack is not None or not g.paged.is_simple:
        raise NotImplementedError(f"reference: member {g.member.name} of a {g.paged.name} group")
    first = cache
    while not isinstance(first, torch.Tensor):
        first = first[0]
    return reference.layouts.leaf_shape(g.member, ext), first.dtype


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


@dataclass(frozen=True)
class ModelChunk:
    """One chunk of a request: tokens [start, end) of the sequence, each group's slots for the
    tokens from `offset` on, the prefix a load skips, and the request's state slot (None: the
    chunk carries no state)."""

    mappings: Mapping[str, Sequence[int]]
    start: int
    end: int
    offset: int = 0
    skip: int = 0
    state_slot: int | None = None


def _move_group(g: GroupCase, cache: list[Any], section: torch.Tensor, chunk: ModelChunk, *, to_cache: bool) -> None:
    shape, dtype = member_object(g, cache, chunk.end - chunk.start)
    work = section.clone().view(dtype).view(shape)  # a private typed copy of the section's bytes
    mapping = [int(s) for s in chunk.mappings[g.name]]
    k = g.tokens_per_slot  # a compressed group's chunk, in its own slots
    start, end, offset, skip = chunk.start // k, chunk.end // k, chunk.offset // k, chunk.skip // k
    span = reference.Span(mapping, start, end, offset, skip)
    pair = (g.paged, g.member, g.ext, cache, work)
    (reference.load if to_cache else reference.store)(*pair, span)
    if not to_cache:
        section.copy_(bits(work).reshape(-1).view(torch.uint8))


def store(case: ModelCase, kvcaches: Sequence[Any], obj: torch.Tensor, chunk: ModelChunk) -> None:
    """Fill the chunk's object (bytes) from the cache, and the state at its state slot."""
    _run(case, kvcaches, obj, chunk, to_cache=False)


def load(case: ModelCase, kvcaches: Sequence[Any], obj: torch.Tensor, chunk: ModelChunk) -> None:
    """Write the chunk's object into the cache at each group's slots, and its state into its state slot."""
    _run(case, kvcaches, obj, chunk, to_cache=True)


def _move_state(row: torch.Tensor, section: torch.Tensor, *, to_cache: bool) -> None:
    if to_cache:
        row.copy_(section.clone().view(row.dtype).view(row.shape))
    else:
        section.copy_(row.contiguous().reshape(-1).view(torch.uint8))


def _run(case: ModelCase, kvcaches: Sequence[Any], obj: torch.Tensor, chunk: ModelChunk, *, to_cache: bool) -> None:
    placed, total = sections(case, kvcaches, chunk.end - chunk.start)
    assert obj.dtype == torch.uint8 and tuple(obj.shape) == (total,), (tuple(obj.shape), total)
    where = {name: obj[at:at + n] for name, at, n in placed}
    for g in case.groups:
        _move_group(g, group_cache(case, g, kvcaches), where[g.name], chunk, to_cache=to_cache)
    if chunk.state_slot is None:
        return
    for s in case.states:
        for layer in s.layers:
            for j, (name, _) in enumerate(s.tensors):
                row = bits(kvcaches[layer][j][chunk.state_slot])
                _move_state(row, where[f"{s.name}[{layer}].{name}"], to_cache=to_cache)
