"""Layout-to-layout transfers through the compiled CPU kernel (kvgen_transfer in csrc/kvcopy.c).

One description per call (the pairs of one chunk) from both caches' layout facts and actual
strides: every axis both sides keep (KV, H narrowed to the call's head ranges, C, and L for a
whole copy) is a dim with both sides' byte strides or leaf steps; the whole-block path adds a
block dim and a position dim, the token path one dim of slots that each side splits by its own
block size. The innermost dims both sides keep contiguous merge into one run moved by memcpy.
A whole copy is one kernel call per path; a layerwise one reuses the description for every
layer, each layer an offset (its leaf, or its byte stride) added per call.

Why: the torch path takes two passes over the data where neither side is consecutive (a
gather into scratch, then a scatter) and one or more parallel regions per layer, whose
barriers wait a scheduling slice each on a busy host. The kernel moves each run once, on
torch's OpenMP team as the connectors do (native.team()).

The generated torch copies stay the fallback (a cache the kernel cannot describe: leaves of
different strides, a device other than the CPU) and the readable reference.
"""

from __future__ import annotations

import array
import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from kvgen.runtime import host, native
from kvgen.runtime.layout import Geometry
from kvgen.runtime.movers.native import address, leaf_set
from kvgen.runtime.movers.program import TransferPath, TransferProgram
from kvgen.runtime.threads import PARALLEL_BYTES, TEAM_PARALLEL_BYTES, cpu_threads
from kvgen.runtime.transfer.pairs import Index, Pairs

#: Int64 fields per dim of kvgen_transfer: the extent, then idx, first, div, cs, cs2, ls per side.
FIELDS = 13
BACKENDS = ("torch", "native")


@dataclass
class _Part:
    dims: array.array
    nd: int
    run: int
    shift: tuple[int, int]  # bytes before the first moved element of every leaf, per side


@dataclass
class TransferDescription:
    """The kernel calls of one transfer call; holds the pairs, so the index tensors it points
    at live as long as it does."""

    parts: list[_Part]
    leaves: tuple[int, int]  # addresses of each side's array of leaf addresses
    #: Per side: (leaf step, byte step) of one layer (layerwise calls only).
    layer: tuple[tuple[int, int], tuple[int, int]]
    pairs: Pairs
    keep: tuple[Any, ...]
    threads_bytes: int  # bytes one kernel call moves (a layer's when layerwise)
    chunk_bytes: int  # bytes of the whole call, every layer
    #: (threads, streaming stores), chosen at the first move: once per call, not per layer.
    picked: tuple[int, int] | None = None


def _fn() -> Any:
    lib = native.library()
    if lib is None:
        raise native.Unsupported(native.unavailable() or "no compiled kernel")
    fn = lib.kvgen_transfer
    if fn.argtypes is None:
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    return fn


def _index(ids: Index | None, what: str) -> tuple[int, int]:
    """(address, first) of one side's ids: a slice is its start, a tensor its int64 values."""
    if isinstance(ids, slice):
        return 0, ids.start
    if not isinstance(ids, torch.Tensor) or ids.device.type != "cpu":
        raise native.Unsupported(f"{what}: CPU index tensors only")
    return address(ids), 0


class _Side:
    """One cache of a transfer as the kernel sees it: its leaf set, where its moved elements
    start, and the geometry it splits slots by."""

    def __init__(self, leaves_: Any, g: Geometry):
        self.c, self.g, self.shift = leaves_, g, 0

    def axis(self, a: str, first: int) -> list[int]:
        """The six fields of shared axis `a` on this side, its first `first` entries skipped."""
        c = self.c
        if a in c.ls:
            if first:
                raise native.Unsupported(f"a range of list level {a}")
            return [0, 0, 1, 0, 0, c.ls[a]]
        if a in c.strides:
            self.shift += first * c.strides[a]
            return [0, 0, 1, c.strides[a], 0, 0]
        return [0, 0, 1, 0, 0, 0]

    def blocks(self, ids: Index | None, n: int, what: str) -> tuple[list[int], list[int]]:
        """The fields of the block dim and of the slots-in-block dim (a folded side: by S)."""
        addr, first = _index(ids, what)
        s = self.c.strides
        folded = self.g.N is None
        return [addr, first, 1, s["S"] * n if folded else s["B"], 0, 0], [0, 0, 1, s["S"] if folded else s["N"], 0, 0]

    def tokens(self, slots: Index | None, what: str) -> list[int]:
        addr, first = _index(slots, what)
        s = self.c.strides
        if self.g.N is None:
            return [addr, first, 1, s["S"], 0, 0]
        return [addr, first, int(self.g.N), s["B"], s["N"], 0]


def _shared_rows(program: TransferProgram, sides: tuple[_Side, _Side], p: Pairs, dims: tuple[str, ...]
                 ) -> dict[str, list[int]]:
    """The row of every shared axis of `dims` with more than one entry (H: this call's heads)."""
    es, ed = _extents(sides[0].g, sides[1].g)
    heads = {"H": (p.src_h, p.dst_h, p.heads)}
    tile = next((a for a in program.shared if a.startswith("H/")), None)
    if tile is not None:  # heads in groups: the call's ranges in whole groups, by the tile
        group = max(sides[0].g.head_group, sides[1].g.head_group)
        if p.src_h % group or p.dst_h % group:
            raise native.Unsupported(f"a head range that starts inside a group of {group} heads")
        heads = {tile: (p.src_h // group, p.dst_h // group, p.heads // group)}
    rows = {}
    for a in program.shared:
        if a not in dims:
            continue
        if a not in heads and es.get(a, 1) != ed.get(a, 1):  # the pair check agrees L, KV, C: never here
            raise native.Unsupported(f"axis {a} has {es.get(a, 1)} entries in src_caches, {ed.get(a, 1)} in dst")
        first_s, first_d, n = heads.get(a, (0, 0, es.get(a, 1)))
        row = [n, *sides[0].axis(a, first_s), *sides[1].axis(a, first_d)]
        if n > 1:
            rows[a] = row
    return rows


def describe(program: TransferProgram, call: Any, layerwise: bool) -> TransferDescription:
    """The kernel calls that move the pairs of `call`, as `program` plans them; Unsupported
    (nothing written) where the kernel cannot move these caches."""
    gs, gd, p = call.gs, call.gd, call.pairs
    if gs.device.type != "cpu" or gd.device.type != "cpu":
        raise native.Unsupported("the compiled kernel moves CPU caches only")
    if program.compiled is not None:
        raise native.Unsupported(program.compiled)
    es, ed = _extents(gs, gd)
    # a side's strides of H's tile and place depend on the group's size: its leaf set is kept per size
    group = max(gs.head_group, gd.head_group)
    sides = (_Side(leaf_set(call.bindings[0], lambda: call.src, program.src_places, program.src_lists, es, group), gs),
             _Side(leaf_set(call.bindings[1], lambda: call.dst, program.dst_places, program.dst_lists, ed, group), gd))
    item = gs.dtype.itemsize
    out: list[_Part] = []
    keep: list[Any] = []
    for path in program.paths:
        if p.has_blocks if path.name == "blocks" else p.has_tokens:
            out.append(_path_part(program, path, sides, call, layerwise, keep))
    layer = tuple((s.c.ls.get("L", 0), 0 if "L" in s.c.ls else s.c.strides.get("L", 0)) for s in sides)
    per_call = p.moved * gs.KV * p.heads * gs.C * item
    total = per_call * gs.L
    return TransferDescription(out, (sides[0].c.base, sides[1].c.base), layer, p,  # type: ignore[arg-type]
                               (sides[0].c, sides[1].c, *keep), per_call if layerwise else total, total)


def _extents(gs: Geometry, gd: Geometry) -> tuple[dict[str, int], dict[str, int]]:
    """Each side's extents by axis name; where a side splits H into groups (`H%g`, the group
    size read from its tensor), both sides see H as those groups (the call checked that two
    grouped sides group alike), the tile's extent H // g."""
    groups = {**dict(gs.splits), **dict(gd.splits)}
    out = []
    for g in (gs, gd):
        ext = {**g.extents(), **groups}
        ext.update({place.replace("%", "/"): g.H // n for place, n in groups.items() if place.startswith("H%")})
        out.append(ext)
    return out[0], out[1]


def _token_rows(path: TransferPath, sides: tuple[_Side, _Side], p: Pairs, keep: list[Any]) -> dict[str, list[int]]:
    """The rows of a path's token dims: B (whole blocks by id) and N (their slots), or T (single
    tokens by slot); the index tensors they point at are kept in `keep`."""
    if path.name == "blocks":
        (b0, n0), (b1, n1) = sides[0].blocks(p.src.blocks, p.block, "src_blocks"), \
            sides[1].blocks(p.dst.blocks, p.block, "dst_blocks")
        keep += [p.src.blocks, p.dst.blocks]
        return {"B": [_count(p.src.blocks), *b0, *b1], "N": [p.block, *n0, *n1]}
    keep += [p.src.slots, p.dst.slots]
    return {"T": [_count(p.src.slots), *sides[0].tokens(p.src.slots, "src_slots"),
                  *sides[1].tokens(p.dst.slots, "dst_slots")]}


def _path_part(program: TransferProgram, path: TransferPath, sides: tuple[_Side, _Side], call: Any,
               layerwise: bool, keep: list[Any]) -> _Part:
    """One kernel call of `path`: its dims in the planned order, the planned run dims merged
    where the live strides are contiguous."""
    p = call.pairs
    dims = path.layer if layerwise else path.whole
    for side in sides:
        side.shift = 0
    rows = {**_shared_rows(program, sides, p, dims), **_token_rows(path, sides, p, keep)}
    names = [d for d in dims if d in rows]
    run, kept = _merge([rows[d] for d in names], names, path.layer_run if layerwise else path.whole_run,
                       call.gs.dtype.itemsize)
    if not kept:  # one run: a dim of one entry carries it
        kept = [[1, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0]]
    if len(kept) > native.MAX_DIMS:
        raise native.Unsupported(f"{len(kept)} dims exceed the kernel's {native.MAX_DIMS}")
    return _Part(array.array("q", [v for d in kept for v in d]), len(kept), run, (sides[0].shift, sides[1].shift))


def _count(ids: Index | None) -> int:
    assert ids is not None
    return ids.stop - ids.start if isinstance(ids, slice) else ids.numel()


def _merge(dims: list[list[int]], names: list[str], run_dims: tuple[str, ...], item: int
           ) -> tuple[int, list[list[int]]]:
    """The innermost planned run dims whose live strides are contiguous on both sides merged
    into the run; then the outermost dim with an entry for each thread first (the threads
    share dim 0: a layer's KV pair alone would keep all but two threads idle)."""
    run = item
    while dims and names[-1] in run_dims:
        d = dims[-1]
        if not all(d[o + 3] == run for o in (1, 7)):
            break
        run *= d[0]
        dims.pop()
        names.pop()
    team = torch.get_num_threads()
    if dims and dims[0][0] < team:
        wide = next((k for k, d in enumerate(dims) if d[0] >= team), None)
        if wide is not None:
            dims.insert(0, dims.pop(wide))
    return run, dims


def move(d: TransferDescription, layer: int | None) -> None:
    """Run the description (one layer of it when `layer` is given)."""
    fn = _fn()
    if d.picked is None:
        d.picked = (cpu_threads(d.threads_bytes, TEAM_PARALLEL_BYTES if native.team() else PARALLEL_BYTES),
                    int(host.streams(d.chunk_bytes)))
    threads, stream = d.picked
    (ls0, cs0), (ls1, cs1) = d.layer if layer is not None else ((0, 0), (0, 0))
    at = layer or 0
    for part in d.parts:
        native.stats["calls"] += 1
        if fn(part.nd, part.dims.buffer_info()[0], part.run, d.leaves[0] + 8 * at * ls0, part.shift[0] + at * cs0,
              d.leaves[1] + 8 * at * ls1, part.shift[1] + at * cs1, threads, stream) != 0:
            raise native.Unsupported("the kernel refused the description")
