"""The compiled CPU mover: executes a connector's PROGRAM with one call of csrc/kvcopy.c per
token path (kvgen.runtime.native compiles and loads the kernel).

From the program it takes where each axis lives on each side, the dims of each call in the
order it walks them, and which innermost dims may merge into the memcpy run; from the live
tensors only their extents, strides and addresses: the byte stride of each axis, each leaf's
address, the chunk's index tensors. It reads no layout facts (PagedLayout / ObjectLayout), so
an altered PROGRAM changes what it moves (tests/test_movers.py shows it).

A step (the kernel calls of one chunk) is kept while the same chunk moves layer after layer,
the steps of recent chunk shapes are reused for later chunks of those shapes with their own
index tensors put in, and a cache's leaf addresses and strides are kept per binding, so a
layer costs one lookup and a chunk of a known shape no description.
"""

from __future__ import annotations

import array
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvgen.runtime import host, native
from kvgen.runtime.aliasing import within_storage
from kvgen.runtime.binding import leaves
from kvgen.runtime.movers.base import Unsupported
from kvgen.runtime.movers.program import CopyPath, CopyProgram, Place
from kvgen.runtime.slots import Chunk
from kvgen.runtime.threads import PARALLEL_BYTES, TEAM_PARALLEL_BYTES, cpu_threads

_lock = threading.Lock()


def strides(places: tuple[Place, ...], tensor: torch.Tensor, ext: dict[str, int]) -> dict[str, int]:
    """Bytes per step of each axis of `tensor`, at its planned place: the stride of its dim
    times the extents of the axes after it in that dim."""
    item, steps = tensor.element_size(), tensor.stride()
    return {a: steps[dim] * item * math.prod(ext[b] for b in inner) for a, dim, inner in places}


class LeafSet:
    """One bound cache as the kernel sees it: its leaves' addresses, one leaf's axis strides and
    each list level's step in leaves."""

    __slots__ = ("binding", "ptrs", "base", "strides", "ls", "item", "shape")

    def __init__(self, binding: Any, tree: Any, places: tuple[Place, ...], lists: tuple[str, ...],
                 ext: dict[str, int]):
        tensors = leaves(tree)
        first = tensors[0]
        if any(t.stride() != first.stride() or t.shape != first.shape for t in tensors[1:]):
            raise Unsupported("cache tensors differ in shape or strides")
        if not all(within_storage(t) for t in tensors):  # every extent the kernel walks is one of these views'
            raise Unsupported("a cache view reaches past its storage")
        self.binding = binding  # held so that id(binding) is not reused while this entry lives
        self.item = first.element_size()
        self.ptrs = array.array("Q", [t.data_ptr() for t in tensors])
        self.base = self.ptrs.buffer_info()[0]
        self.strides = strides(places, first, ext)
        self.shape = tuple(first.shape)
        self.ls: dict[str, int] = {}
        step = 1
        for a in reversed(lists):
            self.ls[a] = step
            step *= ext[a]


_leaf_sets: dict[tuple[int, int], LeafSet] = {}
_KEPT = 16


def leaf_set(binding: Any, tree: Callable[[], Any], places: tuple[Place, ...], lists: tuple[str, ...],
             ext: dict[str, int], variant: int = 0) -> LeafSet:
    """Per binding (immutable, one per cache fingerprint: leaf addresses, shapes, strides) and
    `variant` (what else the strides depend on: a connector's plane, a transfer's head group
    size), so every tree a call brings with that binding has these leaves; without a binding,
    per call. `tree()` makes the tree of leaves, called only when none is kept."""
    key = (id(binding), variant)
    found = _leaf_sets.get(key) if binding is not None else None
    if found is None or found.binding is not binding:
        found = LeafSet(binding, tree(), places, lists, ext)
        if binding is not None:
            with _lock:
                if len(_leaf_sets) >= _KEPT:
                    _leaf_sets.pop(next(iter(_leaf_sets)))
                _leaf_sets[key] = found
    return found


def address(t: torch.Tensor | None) -> int:
    """The address of an index tensor the kernel reads as packed int64 (0 for none)."""
    if t is None:
        return 0
    if t.dtype != torch.int64 or not t.is_contiguous():
        raise Unsupported("index tensors must be contiguous int64")
    return t.data_ptr()


#: Where a dim's fields read a chunk's index tensors (native.FIELDS: idx 1, first 2, tok 6): the
#: block path's B dim its block ids, the token path's T dim its slots and token positions.
_IDX, _FIRST, _TOK = 1, 2, 6


def _chunk_fields(name: str, ck: Chunk) -> tuple[tuple[int, int], ...]:
    """(field, value) of the fields of dim `name` that come from `ck`'s index tensors: an
    address, or a slice's start; () for a dim no index tensor drives."""
    if name == "B":
        idx, first = _index(ck.block_ids)
        return (_IDX, idx), (_FIRST, first)
    if name == "T":
        idx, first = _index(ck.slots)
        return (_IDX, idx), (_FIRST, first), (_TOK, address(ck.tok))
    return ()


def chunk_shape(ck: Chunk) -> tuple[Any, ...]:
    """What a description depends on in a chunk besides its index tensors' addresses: its
    extents, which paths it takes and where its block run starts. Two chunks of one shape
    differ only in the values of their index tensors, so one description serves both with
    those addresses put in (`KernelCall.for_chunk`)."""
    def extent(ids: Any) -> Any:
        if ids is None:
            return None
        return (ids.start, ids.stop) if isinstance(ids, slice) else ids.numel()

    return (ck.num_tokens, ck.moved, ck.block_start, ck.block_tokens, extent(ck.block_ids), extent(ck.slots),
            ck.tok is None)


class KernelCall:
    """One kernel call of a chunk: its dims (flat, native.FIELDS per dim, each named by its
    axis), run bytes and object byte offset."""

    __slots__ = ("dims", "address", "nd", "run", "ooff", "names")

    def __init__(self, dims: list[list[int]], run: int, ooff: int, names: tuple[str, ...]):
        self.dims = array.array("q", [v for d in dims for v in d])
        self.address = self.dims.buffer_info()[0]  # the array is never resized, so its buffer stays put
        self.nd, self.run, self.ooff, self.names = len(dims), run, ooff, names

    def for_chunk(self, ck: Chunk) -> KernelCall:
        """This call for another chunk of the same shape (`chunk_shape`): a copy whose index
        fields point at `ck`'s tensors; this one is left as it is (another thread may run it)."""
        other = KernelCall([], self.run, self.ooff, self.names)
        other.dims = _for_chunk(self.dims, self.names, 1, ck)
        other.address, other.nd = other.dims.buffer_info()[0], self.nd
        return other


def _for_chunk(dims: array.array, names: tuple[str, ...], planes: int, ck: Chunk) -> array.array:
    """A copy of the flat dims of `planes` planes (each the dims `names` names, in order) whose
    fields that read a chunk's index tensors hold `ck`'s (the planes of one walk share them)."""
    copy = array.array("q", dims)
    nd = len(names)
    for k, name in enumerate(names):
        for f, value in _chunk_fields(name, ck):
            for q in range(planes):
                copy[(q * nd + k) * native.FIELDS + f] = value
    return copy


class Description:
    """The kernel calls that move one chunk between a cache and objects of one shape and
    strides (any layer of a layerwise connector: the layer is an offset added per call)."""

    __slots__ = ("cache", "calls")

    def __init__(self, cache: LeafSet, calls: list[KernelCall]):
        self.cache, self.calls = cache, calls

    def for_chunk(self, ck: Chunk) -> Description:
        """This description for another chunk of the same shape (its calls' `for_chunk`)."""
        return Description(self.cache, [c.for_chunk(ck) for c in self.calls])


#: The fields of a dim that every plane of one walk must share (ext, idx, first, div, tok, div2):
#: only strides and leaf steps may differ (csrc/kvcopy.c: kvgen_move_planes).
_SHARED_FIELDS = (0, 1, 2, 3, 6, 9)


class Joint:
    """The planes of one chunk moved in one walk per path (kvgen_move_planes): each path's dims
    of every plane, and per path the heads (run, leaf array, leaf shift, object offset) of each plane."""

    __slots__ = ("planes", "nds", "dims", "head", "_layers", "_names")

    def __init__(self, planes: list[Description]):
        self.planes = len(planes)
        paths = list(zip(*(d.calls for d in planes), strict=True))
        self.nds = [calls[0].nd for calls in paths]
        self.dims = [array.array("q", [v for c in calls for v in c.dims]) for calls in paths]
        self._layers = [(d.cache, calls) for d, calls in zip(planes, zip(*paths, strict=True), strict=True)]
        self.head = self.layer_head(None)
        self._names = [calls[0].names for calls in paths]  # the planes share every dim's axis

    def for_chunk(self, ck: Chunk) -> Joint:
        """This walk for another chunk of the same shape: copies of the dims whose index fields
        point at `ck`'s tensors (in every plane: they share them); heads and caches as they are."""
        other = object.__new__(Joint)
        other.planes, other.nds, other._layers, other.head, other._names = (
            self.planes, self.nds, self._layers, self.head, self._names)
        other.dims = [_for_chunk(dims, names, self.planes, ck) for dims, names in zip(self.dims, self._names,
                                                                                      strict=True)]
        return other

    def layer_head(self, layer: int | None) -> list[array.array]:
        """Each path's heads, for one layer of a per-layer object when `layer` is given."""
        heads: list[list[int]] = [[] for _ in self.nds]
        for cache, calls in self._layers:
            leaf, shift = _layer_offsets(cache, layer)
            for k, c in enumerate(calls):
                heads[k] += [c.run, cache.base + 8 * leaf, shift, c.ooff]
        return [array.array("q", h) for h in heads]


def _layer_offsets(cache: LeafSet, layer: int | None) -> tuple[int, int]:
    """(leaf index, byte shift) of `layer` in a cache: its leaf where layers are leaves, else an
    offset along L; (0, 0) for a whole-chunk call."""
    if layer is None:
        return 0, 0
    if "L" in cache.ls:
        return layer * cache.ls["L"], 0
    return 0, layer * cache.strides.get("L", 0)


def joint(planes: list[Description]) -> Joint | None:
    """The planes' descriptions as one walk per path, where they agree in every dim but its
    strides (the same paths, dims and extents); None where they do not, or there are too many."""
    if not 1 < len(planes) <= native.MAX_PLANES or len({len(d.calls) for d in planes}) != 1:
        return None
    for calls in zip(*(d.calls for d in planes), strict=True):
        if len({c.nd for c in calls}) != 1:
            return None
        first = calls[0].dims
        for c in calls[1:]:
            if any(c.dims[k * native.FIELDS + f] != first[k * native.FIELDS + f]
                   for k in range(c.nd) for f in _SHARED_FIELDS):
                return None
    return Joint(planes)


@dataclass
class Prepared:
    """The native mover's state for one connector: its program, and the threads and streaming
    picked at the first layer of the call now moving (a layerwise call picks once)."""

    program: CopyProgram
    #: The connector: for a cache of several planes, its `_plane_objects` / `_plane_leaves`
    #: make each plane's views.
    connector: Any = None
    #: (the call's serial, {object bytes: (threads, streaming)}): not the call, whose cache it would keep alive.
    picked: tuple[int, dict[int, tuple[int, int]]] = field(default=(0, {}))
    #: The last step moved: (its key, the library, the descriptions, the threads picked); see move().
    step: tuple[Any, ...] | None = None
    #: The work (descriptions or a joint walk) of recent steps, by what it depends on besides the
    #: chunk's index tensors (`_work_key`): a later chunk of the same shape reuses it through
    #: `for_chunk` instead of describing every plane again. Each entry holds its binding.
    recent: dict[tuple[Any, ...], tuple[Any, Any]] = field(default_factory=dict)


#: Steps' work kept per connector and device: the chunk shapes and directions an engine uses.
_RECENT_KEPT = 16



def _index(ids: Any) -> tuple[int, int]:
    """(address, first) of a chunk's block ids or slots: a slice is its start, a tensor its values."""
    return (0, ids.start) if isinstance(ids, slice) else (address(ids), 0)


def _rows(dims: tuple[str, ...], cache: LeafSet, os_: dict[str, int], ext: dict[str, int], ck: Chunk,
          split: tuple[str, ...]) -> list[list[int]]:
    """The kernel's dims of one path in the order `dims`: extent, index, first, div, cache
    stride(s), token positions, object stride, leaf step, place extent, place stride
    (native.FIELDS each). `split`: a block slot's (tile, place), or () for one dim N."""
    cs, ls = cache.strides, cache.ls
    os_t = os_.get("T", 0)
    slot = _slot_rows(cache, ext, os_t, split)
    n = slot[0][0] * (slot[1][0] if split else 1)  # tokens per block
    rows = []
    for name in dims:
        if name == "B":
            rows.append([ck.block_tokens // n, *_index(ck.block_ids), 1, cs["B"], 0, 0, n * os_t, 0, 0, 0])
        elif name in (split or ("N",)):
            rows.append(slot[(split or ("N",)).index(name)])
        elif name == "T":
            rows.append(_token_row(cache, ck, (n, slot[-1][0]), os_t, split))
        elif ext.get(name, 1) > 1:
            rows.append([ext[name], 0, 0, 1, cs.get(name, 0), 0, 0, os_[name], ls.get(name, 0), 0, 0])
    return rows


def _slot_rows(cache: LeafSet, ext: dict[str, int], os_t: int, split: tuple[str, ...]) -> list[list[int]]:
    """The dims of a whole block's slots: N, or its tile (the object's tokens in steps of a
    place's extent) then its place."""
    cs = cache.strides
    if not split:
        return [[ext.get("N", 1), 0, 0, 1, cs.get("N", 0), 0, 0, os_t, 0, 0, 0]]  # folded: no N
    tile, place = split
    return [[ext[tile], 0, 0, 1, cs[tile], 0, 0, ext[place] * os_t, 0, 0, 0],
            [ext[place], 0, 0, 1, cs[place], 0, 0, os_t, 0, 0, 0]]


def _token_row(cache: LeafSet, ck: Chunk, sizes: tuple[int, int], os_t: int, split: tuple[str, ...]) -> list[int]:
    """The dim of single tokens by slot: a folded slot at its stride, else the block (slot // n)
    and its offset, the offset at N's stride or split into a split N's tile and place (offset //
    f, offset % f); `sizes`: (n, f), the tokens of a block and the place's extent."""
    (n, f), cs, slots = sizes, cache.strides, ck.slots
    count = slots.stop - slots.start if isinstance(slots, slice) else slots.numel()  # type: ignore[union-attr]
    if "S" in cs:
        return [count, *_index(slots), 1, cs["S"], 0, address(ck.tok), os_t, 0, 0, 0]
    if split:
        tile, place = split
        return [count, *_index(slots), n, cs["B"], cs[tile], address(ck.tok), os_t, 0, f, cs[place]]
    return [count, *_index(slots), n, cs["B"], cs["N"], address(ck.tok), os_t, 0, 0, 0]


def _merge(rows: list[list[int]], names: list[str], run_dims: tuple[str, ...], item: int
           ) -> tuple[int, list[list[int]]]:
    """The innermost planned run dims whose live strides are contiguous on both sides, merged
    into the run (bytes); the rest stay dims."""
    run = item
    while rows and names[-1] in run_dims:
        d = rows[-1]
        if d[4] != run or d[7] != run:
            break
        run *= d[0]
        rows.pop()
        names.pop()
    return run, rows


def _runs(path: CopyPath, ck: Chunk) -> bool:
    """Whether the chunk has tokens on `path` (a plane without slots moves with any token)."""
    if path.name == "blocks":
        return ck.has_blocks
    return ck.has_tokens if path.name == "tokens" else ck.moved > 0


def _work_key(store: bool, tensor: torch.Tensor, call: Any, ck: Chunk) -> tuple[Any, ...]:
    """What a step's work depends on but its chunk's index tensors: the direction, the chunk's
    shape, the cache's binding (its leaves, strides, geometry) and the object's shape and strides."""
    return (store, chunk_shape(ck), id(call.binding), tensor.shape, tensor.stride(), tensor.element_size())


def describe(program: CopyProgram, store: bool, tensor: torch.Tensor, call: Any, ck: Chunk,
             plane: tuple[int, torch.Tensor, Callable[[], Any]] | None = None) -> Description:
    """The kernel calls that move `ck` between `tensor` and the cache: one per planned path the
    chunk has tokens on. `plane`: (index, its view of `tensor`, what makes its leaf of every
    layer: called only when the binding's leaf set is not kept) for one plane of a cache of
    several; its calls' object offsets then count from `tensor`'s start."""
    binding, g = call.binding, call.g
    ext = g.extents()
    part, view, tree = plane if plane is not None else (0, tensor, lambda: call.kvcaches)
    cache = leaf_set(binding, tree, program.cache_places, program.cache_lists, ext, part)
    if view.element_size() != cache.item:
        raise Unsupported("object and cache elements differ in size")
    if plane is not None:
        ext = {**ext, **plane_extents(program, cache.shape, tuple(view.shape), g)}
    os_ = strides(program.object_places, view, {**ext, "T": ck.num_tokens})
    item, base = view.element_size(), view.data_ptr() - tensor.data_ptr()
    calls = [_path_call(program, path, store, cache, (os_, ext, item, base), ck)
             for path in program.paths if _runs(path, ck)]
    return Description(cache, calls)


def _path_call(program: CopyProgram, path: CopyPath, store: bool, cache: LeafSet,
               view: tuple[dict[str, int], dict[str, int], int, int], ck: Chunk) -> KernelCall:
    """The kernel call of one path: its dims in the path's order, the innermost contiguous ones
    merged into the run; `view`: the object view's byte strides, the extents, the element size
    and the view's byte offset in the object."""
    os_, ext, item, base = view
    dims = path.store if store else path.load
    rows = _rows(dims, cache, os_, ext, ck, program.slot_split)
    names = [d for d in dims if d in ("B", "N", "T", *program.slot_split) or ext.get(d, 1) > 1]
    if len(names) != len(rows):  # each row is named by its axis: for_chunk finds the chunk's fields so
        raise Unsupported(f"dims {names} do not name the kernel's {len(rows)} dims")
    run, rows = _merge(rows, names, path.store_run if store else path.load_run, item)
    if len(rows) > native.MAX_DIMS:  # the kernel's bound: never pass it more
        raise Unsupported(f"{len(rows)} dims exceed the kernel's {native.MAX_DIMS}")
    return KernelCall(rows, run, base + (ck.block_start * os_["T"] if path.name == "blocks" else 0), tuple(names))


def plane_extents(program: CopyProgram, leaf: tuple[int, ...], obj: tuple[int, ...], g: Any) -> dict[str, int]:
    """Each axis's extent in a plane's views, one axis per dim (a tile and a place have no extent
    in the geometry; a plane's C is its bytes, or its values where each value's bytes are E).
    Refused where the two views disagree on an axis both hold, or the leaf holds fewer slots
    than the geometry's (whose bounds the chunk's slots were checked against): the kernel walks
    these extents on both sides."""
    ext = {a: leaf[i] for a, i, _ in program.cache_places}
    for a, i, _ in program.object_places:
        if a in ("L", "T"):  # the object's layers and tokens, checked by the connector
            continue
        if ext.setdefault(a, obj[i]) != obj[i]:
            raise Unsupported(f"plane axis {a}: the cache's view has {ext[a]}, the object's {obj[i]}")
    if program.slotless:
        return ext
    tile, place = program.slot_split or ("N", "")
    n = ext.get(tile, 1) * ext.get(place, 1)
    held = ext["S"] if "S" in ext else ext.get("B", 0) * n
    if held < g.S or ("S" not in ext and n != g.N):
        raise Unsupported(f"a plane's leaf holds {held} slots of {n} per block; the cache has {g.S} of {g.N}")
    return {**ext, "N": n} if program.slot_split else ext


class NativeMover:
    """Moves CPU chunks with the compiled kernel, as the connector's PROGRAM describes them."""

    name = "native"
    stats = native.stats

    def prepare(self, connector: Any, device: torch.device) -> Prepared:
        if device.type != "cpu":
            raise Unsupported(f"the compiled kernel moves CPU tensors only, not {device.type}")
        why = native.unavailable()
        if why is not None:
            raise Unsupported(why)
        program: CopyProgram = connector.program
        if program.compiled is not None:
            raise Unsupported(program.compiled)
        return Prepared(program, connector)

    def move(self, prepared: Prepared, store: bool, tensor: torch.Tensor, call: Any, ck: Chunk,
             layer: int | None) -> None:
        if not ck.has_blocks and not ck.has_tokens:
            return
        # A layerwise call moves the same chunk into objects of one shape layer after layer: the
        # step made for the previous layer serves. Its key holds the call's serial (never reused) and
        # the chunk's id (the call keeps its chunks alive, so no other chunk has it meanwhile).
        key = (call.serial, id(ck), store, tensor.shape, tensor.stride(), tensor.dtype)
        step = prepared.step
        if step is None or step[0] != key:
            step = prepared.step = (key, *self._step(prepared, store, tensor, call, ck, layer))
        _, lib, work, picked = step
        if isinstance(work, Joint):
            self._run_joint(lib, work, store, tensor.data_ptr(), layer, picked)
            return
        for d in work:
            self._run(lib, d, store, tensor.data_ptr(), layer, picked)

    def _step(self, prepared: Prepared, store: bool, tensor: torch.Tensor, call: Any, ck: Chunk,
              layer: int | None) -> tuple[Any, list[Description], tuple[int, int]]:
        """(the library, the descriptions, threads and streaming) that move `ck` with `tensor`."""
        lib = native.library()
        if lib is None:
            raise Unsupported(native.unavailable() or "no compiled kernel")
        picked = self._pick(prepared, tensor, call, layer)
        key = _work_key(store, tensor, call, ck)
        kept = prepared.recent.get(key) if call.binding is not None else None
        if kept is not None and kept[0] is call.binding:
            work = kept[1]
            return lib, work.for_chunk(ck) if isinstance(work, Joint) else [d.for_chunk(ck) for d in work], picked
        program = prepared.program
        if program.planes:
            planes = self._planes(prepared, store, tensor, call, ck)
            work = joint(planes) or planes
        else:
            work = [describe(program, store, tensor, call, ck)]
        if call.binding is not None:
            with _lock:
                if len(prepared.recent) >= _RECENT_KEPT:
                    prepared.recent.pop(next(iter(prepared.recent)))
                prepared.recent[key] = (call.binding, work)
        return lib, work, picked

    @staticmethod
    def _planes(prepared: Prepared, store: bool, tensor: torch.Tensor, call: Any, ck: Chunk) -> list[Description]:
        """Every plane's description, made before the first plane moves (a refusal writes
        nothing)."""
        planes = prepared.program.planes
        connector, g = prepared.connector, call.g
        views = connector._plane_objects(tensor, g, ck)
        made: list[Any] = []

        def leaves_of(i: int) -> Callable[[], Any]:  # every plane's leaves made once, if at all
            def make() -> Any:
                if not made:
                    made.append(connector._plane_leaves(call.kvcaches, g))
                return made[0][i]
            return make

        return [describe(p, store, tensor, call, ck, (i, o, leaves_of(i)))
                for i, (p, o) in enumerate(zip(planes, views, strict=True))]

    def _run(self, lib: Any, d: Description, store: bool, obj: int, layer: int | None,
             picked: tuple[int, int]) -> None:
        """The kernel calls of `d` (of one layer, when `layer` is given)."""
        leaf, coff0 = _layer_offsets(d.cache, layer)
        leaves = d.cache.base + 8 * leaf
        threads, stream = picked
        move, direction = lib.kvgen_move, int(store)
        self.stats["calls"] += len(d.calls)
        for c in d.calls:
            if move(direction, c.nd, c.address, c.run, leaves, coff0, obj + c.ooff, threads, stream) != 0:
                raise Unsupported("the kernel refused the description")

    def _run_joint(self, lib: Any, j: Joint, store: bool, obj: int, layer: int | None,
                   picked: tuple[int, int]) -> None:
        """One walk per path over every plane of a chunk (of one layer, when `layer` is given)."""
        head = j.head if layer is None else j.layer_head(layer)
        threads, stream = picked
        self.stats["calls"] += len(j.dims)
        for k, (nd, dims) in enumerate(zip(j.nds, j.dims, strict=True)):
            at = head[k].buffer_info()[0]
            if lib.kvgen_move_planes(int(store), nd, j.planes, dims.buffer_info()[0], at, obj, threads, stream) != 0:
                raise Unsupported("the kernel refused the planes' description")

    @staticmethod
    def _pick(prepared: Prepared, tensor: torch.Tensor, call: Any, layer: int | None) -> tuple[int, int]:
        """Threads and streaming stores for this object size: picked once per call and size (a
        layerwise call at its first layer), from the whole chunk's bytes for streaming."""
        nbytes = tensor.numel() * tensor.element_size()
        owner, sizes = prepared.picked
        if owner != call.serial:
            sizes = {}
            prepared.picked = (call.serial, sizes)
        found = sizes.get(nbytes)
        if found is None:
            found = sizes[nbytes] = (_threads(nbytes),
                                     int(host.streams(nbytes * (call.g.L if layer is not None else 1))))
        return found


def _threads(nbytes: int) -> int:
    """Threads a kernel call moving `nbytes` runs on: the lower threshold where its shares run on
    torch's team, whose workers are spinning or a futex wake away."""
    return cpu_threads(nbytes, TEAM_PARALLEL_BYTES if native.team() else PARALLEL_BYTES)


def copy_state_rows(rows: list[tuple[torch.Tensor, Any]], tensor: torch.Tensor, slot: int, storing: bool) -> bool:
    """Copy each state tensor's row `slot` to (storing) or from its section of the object's bytes
    `tensor`, all in one kernel call (kvgen_copy_rows); `rows`: (state tensor [S, ...], its
    Section). False, with nothing moved, where the kernel cannot: not on the CPU, no compiled
    kernel, a strided object or row, or a section that is not the row's size."""
    lib = native.library() if tensor.device.type == "cpu" else None
    if lib is None or not rows or tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
        return False
    base, have = tensor.data_ptr(), tensor.numel()
    flat: list[int] = []
    for state, section in rows:
        row = _row(state, slot)
        if row is None or section.nbytes != row[1] or section.offset + section.nbytes > have:
            return False
        if not row[1]:
            continue  # an empty row moves nothing
        at = base + section.offset
        flat += [at, row[0], row[1]] if storing else [row[0], at, row[1]]
    total = sum(flat[2::3])
    runs = array.array("q", flat)
    threads = _threads(total)
    if lib.kvgen_copy_rows(len(runs) // 3, runs.buffer_info()[0], threads, int(host.streams(total))) != 0:
        raise Unsupported("the kernel refused a state row")  # never before a byte is moved
    return True


def _row(state: torch.Tensor, slot: int) -> tuple[int, int] | None:
    """(address, bytes) of `state[slot]` where that row is contiguous and inside the tensor; else None."""
    if not state.is_cpu or not 0 <= slot < state.shape[0]:
        return None
    step = state.element_size()
    for n, stride in zip(reversed(state.shape[1:]), reversed(state.stride()[1:]), strict=True):
        if n > 1 and stride * state.element_size() != step:
            return None
        step *= n
    return state.data_ptr() + slot * state.stride(0) * state.element_size(), step
