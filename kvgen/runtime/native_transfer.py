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
from kvgen.runtime.layout import Geometry, PagedLayout
from kvgen.runtime.movers.native import address, leaf_set
from kvgen.runtime.movers.program import Place
from kvgen.runtime.pairs import Index, Pairs
from kvgen.runtime.threads import PARALLEL_BYTES, TEAM_PARALLEL_BYTES, cpu_threads

#: Int64 fields per dim of kvgen_transfer: the extent, then idx, first, div, cs, cs2, ls per side.
FIELDS = 13
_TOKEN_AXES = {"B", "N", "S"}
BACKENDS = ("torch", "native")


def _places(layout: PagedLayout) -> tuple[Place, ...]:
    """Where each axis of a cache leaf lives (the movers' Place), read from its layout: transfers
    are not yet planned at build time (connectors are: kvgen.plan.program)."""
    out: list[Place] = []
    for i, axes in enumerate(layout.dims):
        if axes == ("B", "N"):
            out.append(("S", i, ()))
            continue
        out.extend((a, i, axes[k + 1:]) for k, a in enumerate(axes))
    return tuple(out)


@dataclass
class _Part:
    dims: array.array
    nd: int
    run: int
    shift: tuple[int, int]  # bytes before the first moved element of every leaf, per side


@dataclass
class Description:
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


def describe(src_layout: PagedLayout, dst_layout: PagedLayout, src_tree: Any, dst_tree: Any, gs: Geometry,
             gd: Geometry, p: Pairs, bindings: tuple[Any, Any], layerwise: bool) -> Description:
    """The kernel calls that move the pairs `p`; Unsupported (nothing written) when the kernel
    cannot describe these caches."""
    if gs.device.type != "cpu" or gd.device.type != "cpu":
        raise native.Unsupported("the compiled kernel moves CPU caches only")
    if src_layout.parts or dst_layout.parts:
        raise native.Unsupported("caches of several planes move by torch ops")
    es, ed = gs.extents(), gd.extents()
    cs = leaf_set(bindings[0], src_tree, _places(src_layout), src_layout.lists, es)
    cd = leaf_set(bindings[1], dst_tree, _places(dst_layout), dst_layout.lists, ed)
    item = gs.dtype.itemsize
    heads = {"H": (p.src_h, p.dst_h, p.heads)}
    axes = ({a for d in src_layout.dims for a in d} | set(src_layout.lists)
            | {a for d in dst_layout.dims for a in d} | set(dst_layout.lists)) - _TOKEN_AXES
    if layerwise:
        axes.discard("L")
    shared: list[list[int]] = []
    shift = [0, 0]
    for a in sorted(axes):
        if a not in heads and es.get(a, 1) != ed.get(a, 1):  # the pair check agrees L, KV, C: never here
            raise native.Unsupported(f"axis {a} has {es.get(a, 1)} entries in src_caches, {ed.get(a, 1)} in dst")
        first_s, first_d, n = heads.get(a, (0, 0, es.get(a, 1)))
        row = [n]
        for k, (c, first) in enumerate(((cs, first_s), (cd, first_d))):
            if a in c.ls:
                if first:
                    raise native.Unsupported(f"a range of list level {a}")
                row += [0, 0, 1, 0, 0, c.ls[a]]
            elif a in c.strides:
                shift[k] += first * c.strides[a]
                row += [0, 0, 1, c.strides[a], 0, 0]
            elif n > 1:
                raise native.Unsupported(f"axis {a} is on one side only")
            else:
                row += [0, 0, 1, 0, 0, 0]
        if n > 1:
            shared.append(row)
    parts: list[tuple[list[list[int]], tuple[int, int]]] = []
    keep: list[Any] = []
    if p.has_blocks:
        n = p.block
        blocks: list[int] = [_count(p.src.blocks)]
        within: list[int] = [n]
        for c, g, side, what in ((cs, gs, p.src, "src_blocks"), (cd, gd, p.dst, "dst_blocks")):
            addr, first = _index(side.blocks, what)
            keep.append(side.blocks)
            step = c.strides["S"] * n if g.N is None else c.strides["B"]
            blocks += [addr, first, 1, step, 0, 0]
            within += [0, 0, 1, c.strides["S"] if g.N is None else c.strides["N"], 0, 0]
        parts.append(([blocks, within, *shared], (shift[0], shift[1])))
    if p.has_tokens:
        tok: list[int] = [_count(p.src.slots)]
        for c, g, side, what in ((cs, gs, p.src, "src_slots"), (cd, gd, p.dst, "dst_slots")):
            addr, first = _index(side.slots, what)
            keep.append(side.slots)
            if g.N is None:
                tok += [addr, first, 1, c.strides["S"], 0, 0]
            else:
                tok += [addr, first, int(g.N), c.strides["B"], c.strides["N"], 0]
        parts.append(([tok, *shared], (shift[0], shift[1])))
    out = []
    for dims, (s0, s1) in parts:
        run, dims = _order(dims, item)
        if not dims:  # one run: a dim of one entry carries it
            dims = [[1, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0]]
        if len(dims) > native.MAX_DIMS:
            raise native.Unsupported(f"{len(dims)} dims exceed the kernel's {native.MAX_DIMS}")
        out.append(_Part(array.array("q", [v for d in dims for v in d]), len(dims), run, (s0, s1)))
    layer = tuple((c.ls.get("L", 0), 0 if "L" in c.ls else c.strides.get("L", 0)) for c in (cs, cd))
    per_call = p.moved * gs.KV * p.heads * gs.C * item
    total = per_call * gs.L
    return Description(out, (cs.base, cd.base), layer, p, (cs, cd, *keep),  # type: ignore[arg-type]
                       per_call if layerwise else total, total)


def _count(ids: Index | None) -> int:
    assert ids is not None
    return ids.stop - ids.start if isinstance(ids, slice) else ids.numel()



def _order(dims: list[list[int]], item: int) -> tuple[int, list[list[int]]]:
    """Dims outermost first in the destination's order (written front to back), then the
    innermost dims both sides keep contiguous merged into the run."""
    dims = sorted(dims, key=lambda d: (-d[12], -d[10]))
    run = item
    while dims:
        d = dims[-1]
        plain = all(d[o] == 0 and d[o + 1] == 0 and d[o + 2] == 1 and d[o + 5] == 0 and d[o + 3] == run
                    for o in (1, 7))
        if not plain:
            break
        run *= d[0]
        dims.pop()
    # The threads share dim 0: put first the outermost dim with an entry for each of them
    # (a layer's KV pair alone would keep all but two threads idle).
    team = torch.get_num_threads()
    if dims and dims[0][0] < team:
        wide = next((k for k, d in enumerate(dims) if d[0] >= team), None)
        if wide is not None:
            dims.insert(0, dims.pop(wide))
    return run, dims


def move(d: Description, layer: int | None) -> None:
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
