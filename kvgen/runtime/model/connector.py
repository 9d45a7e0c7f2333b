"""Model connectors: a whole model's cache (attention groups with their own block tables, and
per-request state) to and from one groups object per chunk (KVGEN_GROUPS, ...).

A generated model module holds only tables (kvgen.runtime.model.table) and subclasses
`ModelConnector`. Each carried group is moved by its *member* connector, the generated
whole-chunk connector of (group layout, member object), on the group's entries of the cache
list with the group's own slot mapping; so every check a connector runs on a cache, a slot
mapping and an object applies to each group. The model adds the declared geometry, the state
tensors, the state slot, and object checks across groups. Everything is checked before the
first write: a refused call leaves every object and every cache entry as it was.

State rule: a request's state slot holds the state after the last token the engine
computed, so the state travels with the chunk that ends there (the last chunk of the stored
prefix); pass its slot for that chunk and None for the others. See docs/connectors.md.
"""

from __future__ import annotations

import functools
import importlib
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvgen.runtime import calls
from kvgen.runtime.aliasing import CacheMemory, check_cache_memory, check_objects_apart
from kvgen.runtime.binding import leaf_names, leaves, snapshot
from kvgen.runtime.calls import MISSING
from kvgen.runtime.connector import Call, ConnectorBase, _integer, _positions, token_count
from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.layout import Geometry, ObjectLayout, describe
from kvgen.runtime.memory import Format, MemoryObj, relabel
from kvgen.runtime.model.checks import (
    StateFacts,
    check_declared,
    check_states,
    entries,
    group_where,
    mappings,
    object_bytes,
    state_slots,
)
from kvgen.runtime.model.table import GroupTable, Section, StateTable, dtype_name, lay_out, state_section_name
from kvgen.runtime.movers.native import copy_state_rows

STORE = ("kvcaches", "slot_mappings", "state_slot", "offset")
LOAD = (*STORE, "skip_prefix_n_tokens")
BATCHED_STORE = ("kvcaches", "slot_mappings", "state_slots", "offset")
BATCHED_LOAD = (*BATCHED_STORE, "skip_prefix_n_tokens")

_BINDINGS_KEPT = 8


@dataclass(frozen=True)
class ModelBinding:
    """One cache list as checked: each group's geometry, the state facts, and the memory of
    every carried cache tensor and state tensor (for the object-overlap checks)."""

    geometries: tuple[Geometry, ...]
    state: StateFacts
    memory: CacheMemory
    names: tuple[str, ...]
    device: torch.device | None


@dataclass(frozen=True)
class _Request:
    """One call's inputs, as the caller passed them: per chunk an object, a start, an end and a
    state slot (or None); the cache list, each group's slot mapping, the offset of the slot
    mappings and the prefix a load skips."""

    memory_objs: Sequence[Any]
    starts: Sequence[int]
    ends: Sequence[int]
    kvcaches: Any
    slot_mappings: Any
    state_slots: Any
    offset: int
    skip: int = 0


#: Per chunk: token counts, state slots, objects as bytes, their sections.
_Chunks = tuple[list[int], list[Any], list[torch.Tensor], list[tuple[Section, ...]]]


@dataclass
class _Piece:
    """One group section of one chunk's object: the member-typed tensor a copy works on, and
    where its bytes go when the object's bytes cannot be viewed as the member's dtype."""

    work: torch.Tensor
    target: torch.Tensor | None = None


class ModelConnector:
    """Moves a model's cache to and from groups objects (bytes); see the module docstring."""

    model: ClassVar[str]
    layers: ClassVar[int]
    memory: ClassVar[ObjectLayout]
    group_names: ClassVar[tuple[str, ...]]
    groups: ClassVar[tuple[GroupTable, ...]]
    states: ClassVar[tuple[StateTable, ...]]
    views: ClassVar[dict[str, str]] = {}
    #: The groups overlay each other in one allocation (the model spec's `overlaid`): leaves of
    #: different groups may share memory, leaves of one group never.
    overlaid: ClassVar[bool] = False

    def __init__(self, device: torch.device | str | None = None, *, tp: int = 1, backend: Any = None):
        """`device`: where the caches live (default: the first cache's). `tp`: this rank's tensor
        parallelism; groups hold H / tp heads, state tensors their split dim / tp. `backend`: as
        for every connector (kvgen.runtime.connector), passed to each group's member."""
        self.tp = _integer("tp", tp)
        if self.tp < 1:
            raise KVLayoutError(f"{self.model}: tp must be at least 1, got {tp}")
        for g in self.groups:
            heads = g.size("H")
            if heads is not None and heads % self.tp:
                raise KVLayoutError(f"{self.model}: {group_where(g)} has H = {heads} heads, which tp={self.tp} "
                                    "does not divide")
        for s in self.states:
            for name, shape, _, split in s.tensors:
                if split is not None and shape[split] % self.tp:
                    raise KVLayoutError(f"{self.model}: state {s.name!r} tensor {name!r} splits dim {split} of "
                                        f"{list(shape)} over tp={self.tp}, which does not divide it")
        package = type(self).__module__.rpartition(".")[0]
        self.members: dict[str, ConnectorBase] = {}
        for g in self.groups:
            cls = importlib.import_module(f".{g.module}", package).Connector
            self.members[g.name] = cls(device=device, backend=backend)
        self.device = next(iter(self.members.values())).device if self.members else None
        self.format = Format(self.memory.format, self.memory.code)
        self._lock = threading.Lock()
        self._bindings: dict[Any, ModelBinding] = {}
        self._last: ModelBinding | None = None

    # -- binding -------------------------------------------------------------------------

    def bind(self, kvcaches: Any) -> ModelBinding:
        """Check the whole cache list (every carried group and state); later calls with an
        unchanged list reuse the result."""
        items = entries(self.model, self.layers, kvcaches)
        _, key = snapshot(items)
        found = self._bindings.get(key) if key is not None else None
        if found is None:
            found = self._new_binding(items, key)
        self._last = found
        return found

    def _group_entries(self, g: GroupTable, items: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(items[i] for i in g.layers)

    def _member_bind(self, g: GroupTable, items: tuple[Any, ...]) -> Geometry:
        try:
            return self.members[g.name].bind(self._group_entries(g, items))
        except KVLayoutError as error:
            raise KVLayoutError(f"{self.model}: {group_where(g)}: {error}") from None

    def _new_binding(self, items: tuple[Any, ...], key: Any) -> ModelBinding:
        geometries, tensors, names, apart = [], [], [], []
        device = None
        for g in self.groups:
            geometry = self._member_bind(g, items)
            parts = self.members[g.name].layout.parts
            check_declared(self.model, g, geometry, self.tp, parts[0][0] if parts else None)
            if device is not None and geometry.device != device:
                raise KVLayoutError(f"{self.model}: {group_where(g)} is on {geometry.device}, an earlier group on "
                                    f"{device}: every group of a model's cache lives on one device")
            device = geometry.device
            geometries.append(geometry)
            apart.append(len(tensors))
            for i in g.layers:
                tensors += leaves(items[i])
                names += leaf_names(items[i], f"kvcaches[{i}]")
        facts, state_tensors, state_names = check_states(self.model, self.states, items, self.tp, device)
        device = device if device is not None or not state_tensors else state_tensors[0].device
        # Overlaid groups may share memory with each other, never within one group (nor its state).
        apart = [*apart, len(tensors)] if self.overlaid else []
        memory = check_cache_memory([*tensors, *state_tensors], [*names, *state_names], apart)
        binding = ModelBinding(tuple(geometries), facts, memory, (*names, *state_names), device)
        if key is not None:
            with self._lock:
                if len(self._bindings) >= _BINDINGS_KEPT:
                    self._bindings.pop(next(iter(self._bindings)))
                self._bindings[key] = binding
        return binding

    def _binding(self, kvcaches: Any) -> ModelBinding:
        if kvcaches is not None:
            return self.bind(kvcaches)
        if self._last is None:
            raise KVLayoutError(f"{type(self).__module__}: no cache bound yet; pass kvcaches or call bind(kvcaches)")
        return self._last

    # -- the object ----------------------------------------------------------------------

    def _member_shape(self, g: GroupTable, geometry: Geometry, num_tokens: int) -> tuple[tuple[int, ...], torch.dtype]:
        member = self.members[g.name]
        slots = g.slots_of(num_tokens, "a chunk of") if g.tokens_per_slot != 1 else num_tokens
        return tuple(member._shape(geometry, slots)), member._dtype(geometry)

    def _sections(self, b: ModelBinding, num_tokens: int) -> tuple[tuple[Section, ...], int]:
        pieces = []
        for g, geometry in zip(self.groups, b.geometries, strict=True):
            shape, dtype = self._member_shape(g, geometry, num_tokens)
            nbytes = math.prod(shape) * dtype.itemsize
            pieces.append((g.name, "group", nbytes, f"{g.member} {list(shape)} {dtype_name(dtype)}"))
        for s, per_layer in zip(self.states, b.state.dtypes, strict=True):
            for layer, dtypes in zip(s.layers, per_layer, strict=True):
                for spec, dtype in zip(s.tensors, dtypes, strict=True):
                    shape = StateTable.rank_shape(spec, self.tp)
                    pieces.append((state_section_name(s.name, layer, spec[0]), "state",
                                   math.prod(shape) * dtype.itemsize, f"{list(shape)} {dtype_name(dtype)}"))
        return lay_out(pieces)

    def sections(self, num_tokens: int, kvcaches: Any = None) -> tuple[Section, ...]:
        """(name, kind, offset, nbytes, detail) of each section of a chunk's object."""
        count = token_count(num_tokens)
        return self._sections(self._binding(kvcaches), count)[0]

    def get_shape(self, num_tokens: int, kvcaches: Any = None) -> torch.Size:
        """The object of a chunk of `num_tokens`: [bytes] (for `kvcaches`, default the cache bound last)."""
        count = token_count(num_tokens)
        return torch.Size([self._sections(self._binding(kvcaches), count)[1]])

    def get_dtype(self, kvcaches: Any = None) -> torch.dtype:
        return torch.uint8

    def _group(self, name: str) -> GroupTable:
        for g in self.groups:
            if g.name == name:
                return g
        raise KVLayoutError(f"{self.model}: {self.memory.name} carries no group {name!r} "
                            f"(it carries: {', '.join(g.name for g in self.groups) or 'none'})")

    def member_view(self, memory_obj: Any, group: str, num_tokens: int, kvcaches: Any = None) -> Any:
        """The section of `group` as its member object, sharing memory: a tensor for a tensor,
        a MemoryObj labelled with the member's format for a memory object."""
        b = self._binding(kvcaches)
        g = self._group(group)
        sections, total = self._sections(b, num_tokens)
        tensor = object_bytes(memory_obj, 0, self.memory, total, storing=True)
        section = next(s for s in sections if s.name == g.name and s.kind == "group")
        shape, dtype = self._member_shape(g, b.geometries[self.groups.index(g)], num_tokens)
        piece = tensor[section.offset:section.offset + section.nbytes]
        if piece.storage_offset() % dtype.itemsize:
            raise KVLayoutError(f"{self.model}: the object's bytes start at an offset {dtype_name(dtype)} cannot be "
                                "viewed at; copy the object into aligned memory first")
        view = piece.view(dtype).view(shape)
        if isinstance(memory_obj, torch.Tensor):
            return view
        return MemoryObj(view, relabel(memory_obj.metadata.fmt, self.members[g.name].format))

    def view_as(self, memory_obj: Any, target: str, num_tokens: int, kvcaches: Any = None) -> Any:
        """This object as `target`, another groups object of the model whose sections are a
        prefix of this one's (kv_groups -> kv_groups_attention): a view of its first bytes."""
        names = {n.lower(): n for n in self.views}
        if target.lower() not in names:
            raise KVLayoutError(f"{self.model}: no view from {self.memory.name} to {target}; views: "
                                f"{', '.join(self.views) or 'none'}")
        package = type(self).__module__.rpartition(".")[0]
        other = importlib.import_module(f".{self.views[names[target.lower()]]}", package).Connector
        b = self._binding(kvcaches)
        mine, total = self._sections(b, num_tokens)
        tensor = object_bytes(memory_obj, 0, self.memory, total, storing=False)
        theirs = [(g.name, "group") for g in other.groups] + \
            [(state_section_name(s.name, layer, t[0]), "state") for s in other.states for layer in s.layers
             for t in s.tensors]
        if [(s.name, s.kind) for s in mine[:len(theirs)]] != theirs:
            raise KVLayoutError(f"{self.model}: {other.memory.name} is not a prefix of {self.memory.name}")
        end = mine[len(theirs)].offset if len(theirs) < len(mine) else total
        view = tensor[:end]
        if isinstance(memory_obj, torch.Tensor):
            return view
        return MemoryObj(view, Format(other.memory.format, other.memory.code))

    # -- calls ---------------------------------------------------------------------------

    def from_gpu(self, memory_obj: Any, start: int, end: int, *, kvcaches: Any = MISSING, slot_mappings: Any = MISSING,
                 state_slot: int | None = None, offset: int = 0, **unknown: Any) -> None:
        """Copy tokens [start, end) of every carried group, and the state at `state_slot`, into `memory_obj`."""
        calls.check_keywords("from_gpu", unknown, STORE, kvcaches=kvcaches, slot_mappings=slot_mappings)
        self._run(_Request([memory_obj], [start], [end], kvcaches, slot_mappings, [state_slot], offset), storing=True)

    def to_gpu(self, memory_obj: Any, start: int, end: int, *, kvcaches: Any = MISSING, slot_mappings: Any = MISSING,
               state_slot: int | None = None, offset: int = 0, skip_prefix_n_tokens: int = 0, **unknown: Any) -> None:
        """Copy `memory_obj` into every carried group at its slots, and its state into `state_slot`."""
        calls.check_keywords("to_gpu", unknown, LOAD, kvcaches=kvcaches, slot_mappings=slot_mappings)
        self._run(_Request([memory_obj], [start], [end], kvcaches, slot_mappings, [state_slot], offset,
                           skip_prefix_n_tokens), storing=False)

    def batched_from_gpu(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int], *,
                         kvcaches: Any = MISSING, slot_mappings: Any = MISSING,
                         state_slots: Sequence[int | None] | None = None, offset: int = 0, **unknown: Any) -> None:
        """from_gpu for each chunk; `state_slots`: one request slot (or None) per chunk."""
        calls.check_keywords("batched_from_gpu", unknown, BATCHED_STORE, kvcaches=kvcaches, slot_mappings=slot_mappings)
        self._run(_Request(memory_objs, starts, ends, kvcaches, slot_mappings, state_slots, offset), storing=True)

    def batched_to_gpu(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int], *,
                       kvcaches: Any = MISSING, slot_mappings: Any = MISSING,
                       state_slots: Sequence[int | None] | None = None, offset: int = 0, skip_prefix_n_tokens: int = 0,
                       **unknown: Any) -> None:
        """to_gpu for each chunk; `state_slots`: one request slot (or None) per chunk."""
        calls.check_keywords("batched_to_gpu", unknown, BATCHED_LOAD, kvcaches=kvcaches, slot_mappings=slot_mappings)
        self._run(_Request(memory_objs, starts, ends, kvcaches, slot_mappings, state_slots, offset,
                           skip_prefix_n_tokens), storing=False)

    def _group_calls(self, req: _Request, items: tuple[Any, ...]) -> list[Call]:
        """Each carried group's call on its member connector: its entries bound, its slots planned."""
        maps = mappings(self.model, self.group_names, [g.name for g in self.groups], req.slot_mappings,
                        {g.name: g.tokens_per_slot for g in self.groups})
        out = []
        for g in self.groups:
            try:
                starts, ends, offset, skip = _in_slots(g, req)
                out.append(self.members[g.name]._begin(self._group_entries(g, items), maps[g.name], starts,
                                                       ends, offset, skip))
            except KVLayoutError as error:
                raise KVLayoutError(f"{self.model}: {group_where(g)}: {error}") from None
        return out

    def _chunks(self, req: _Request, b: ModelBinding, storing: bool) -> _Chunks:
        """Per chunk: its token count, state slot, object as bytes and sections; the objects
        apart from each other and from the cache."""
        count = len(_positions("starts", req.starts))
        if not isinstance(req.memory_objs, Sequence) or len(req.memory_objs) != count:
            raise KVLayoutError(f"expected a list of {count} memory objects (one per chunk), got "
                                f"{describe(req.memory_objs)}")
        lengths = [e - s for s, e in zip(_positions("starts", req.starts), _positions("ends", req.ends), strict=True)]
        slots = state_slots(self.model, req.state_slots, count, b.state.slots, bool(self.states), storing)
        tensors, layouts = [], []
        for k, (obj, n) in enumerate(zip(req.memory_objs, lengths, strict=True)):
            sections, total = self._sections(b, n)
            tensors.append(object_bytes(obj, k, self.memory, total, storing))
            layouts.append(sections)
        check_objects_apart(tensors, lambda k: f"for chunk {k}", b.memory, b.names)
        return lengths, slots, tensors, layouts

    def _check_members(self, req: _Request, group_calls: list[Call], pieces: list[list[_Piece]],
                       storing: bool) -> None:
        """Each member's own checks of its pieces: staging, and for a load each slot written once."""
        for i, g in enumerate(self.groups):
            member = self.members[g.name]
            try:
                member._check_staging([chunk[i].work for chunk in pieces])
                if not storing:
                    member._check_unique_slots(group_calls[i])
            except KVLayoutError as error:
                raise KVLayoutError(f"{self.model}: {group_where(g)}: {error}") from None

    def _run(self, req: _Request, *, storing: bool) -> None:
        # -- every check, for every group and the state, before the first write
        b = self.bind(req.kvcaches)
        items = entries(self.model, self.layers, req.kvcaches)
        group_calls = self._group_calls(req, items)
        lengths, slots, tensors, layouts = self._chunks(req, b, storing)
        pieces = [[self._piece(g, b.geometries[i], t[sections[i].offset:sections[i].offset + sections[i].nbytes], n,
                               storing, k) for i, g in enumerate(self.groups)]
                  for k, (t, sections, n) in enumerate(zip(tensors, layouts, lengths, strict=True))]
        self._check_members(req, group_calls, pieces, storing)
        # -- the copies
        for k, tensor in enumerate(tensors):
            for i, g in enumerate(self.groups):
                self._move_group(g, group_calls[i], group_calls[i].chunks[k], pieces[k][i], storing)
            if slots[k] is not None:
                self._move_state(items, tensor, layouts[k], slots[k], storing)
            obj = req.memory_objs[k]
            if storing and not isinstance(obj, torch.Tensor):
                obj.metadata.fmt = relabel(obj.metadata.fmt, self.format)
        for i, g in enumerate(self.groups):
            backend = self.members[g.name]._backend_for(group_calls[i].g.device)
            backend.synchronize(backend.current_stream())

    def _piece(self, g: GroupTable, geometry: Geometry, raw: torch.Tensor, num_tokens: int, storing: bool,
               k: int) -> _Piece:
        """The group's section (`raw`, its bytes in chunk k's object) as the member object, checked by
        the member's own object check."""
        shape, dtype = self._member_shape(g, geometry, num_tokens)
        if raw.storage_offset() % dtype.itemsize == 0:
            piece = _Piece(raw.view(dtype).view(shape))
        else:  # bytes at an offset the dtype cannot view: the copy works on an aligned tensor
            work = torch.empty(shape, dtype=dtype, device=raw.device)
            if not storing:
                work.view(torch.uint8).view(-1).copy_(raw)
            piece = _Piece(work, raw)
        member = self.members[g.name]
        slots = num_tokens // g.tokens_per_slot  # whole slots: _member_shape refused any other count
        try:
            member._check_object(MemoryObj(piece.work, member.format), geometry, slots, storing=storing)
        except KVLayoutError as error:
            raise KVLayoutError(f"{self.model}: {group_where(g)}, chunk {k}: {error}") from None
        return piece

    def _move_group(self, g: GroupTable, call: Call, ck: Any, piece: _Piece, storing: bool) -> None:
        member = self.members[g.name]
        if storing:
            if piece.target is not None and not ck.covers_all:
                piece.work.view(torch.uint8).view(-1).copy_(piece.target)  # skipped tokens keep their bytes
            member._staged_store(piece.work, call, ck, "whole")
            if piece.target is not None:
                piece.target.copy_(piece.work.reshape(-1).view(torch.uint8))
        else:
            member._staged_load(piece.work, call, ck, "whole")

    def _move_state(self, items: tuple[Any, ...], tensor: torch.Tensor, sections: tuple[Section, ...], slot: int,
                    storing: bool) -> None:
        at = {s.name: s for s in sections if s.kind == "state"}
        rows = [(items[layer][j], at[name]) for layer, j, name in _state_entries(self.states)]
        if copy_state_rows(rows, tensor, slot, storing):
            return
        for state, section in rows:  # the torch path: a device without the kernel, or a strided row
            raw = tensor[section.offset:section.offset + section.nbytes]
            if storing:
                raw.copy_(state[slot].contiguous().reshape(-1).view(torch.uint8))
            else:
                src = raw if raw.storage_offset() % state.element_size() == 0 else raw.clone()
                state[slot].copy_(src.view(state.dtype).view(state.shape[1:]))


@functools.cache
def _state_entries(states: tuple[StateTable, ...]) -> tuple[tuple[int, int, str], ...]:
    """(cache-list entry, tensor index, section name) of every state tensor a model carries, in order."""
    return tuple((layer, j, state_section_name(s.name, layer, spec[0]))
                 for s in states for layer in s.layers for j, spec in enumerate(s.tensors))


def _in_slots(g: GroupTable, req: _Request) -> tuple[Any, Any, int, int]:
    """A request's starts, ends, offset and skipped prefix in the group's stored slots: the same
    positions for one token per slot, divided by k (each a multiple of k) for k tokens per slot."""
    if g.tokens_per_slot == 1:
        return req.starts, req.ends, req.offset, req.skip
    starts = [g.slots_of(int(s), "start") for s in _positions("starts", req.starts)]
    ends = [g.slots_of(int(e), "end") for e in _positions("ends", req.ends)]
    return (starts, ends, g.slots_of(_integer("offset", req.offset), "offset"),
            g.slots_of(_integer("skip_prefix_n_tokens", req.skip), "skip_prefix_n_tokens"))


def carried(connector: ModelConnector) -> Mapping[str, tuple[str, ...]]:
    """The groups and state groups a model connector's object carries."""
    return {"groups": tuple(g.name for g in connector.groups), "state": tuple(s.name for s in connector.states)}
