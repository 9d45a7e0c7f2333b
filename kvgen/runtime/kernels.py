"""Generated Triton kernels at run time: where they run, and launching one.

Every connector module `<layout>__<object>.py` has a twin `<layout>__<object>_triton.py`
holding one Triton kernel (both directions) and a `Kernel` that launches it; for a cache of
several planes, one kernel per plane and a `PlanesKernel` over them. Every launch fact that
depends on the plan alone (row and outer axes, whether programs step over blocks, the most
tokens per tile, the strides a row's alignment divides) is the twin's `KernelSpec`, written by
kvgen.plan.kernel; a launch reads the connector's PROGRAM for the places of the views and the
live extents, strides and addresses for the rest. The Triton mover
(kvgen.runtime.movers.triton) calls them; which devices they run on is the device
registry's fact (kvgen.runtime.devices). On the CPU, Triton runs only in its interpreter
(`TRITON_INTERPRET=1`), which the tests and `kvgen verify --backend triton` use to check
every kernel against the reference; auto never picks it there.

Triton is imported only when a kernel is about to be used, so kvgen needs it for nothing
else (`pip install 'kvgen[triton]'`).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from kvgen.runtime.binding import leaves
from kvgen.runtime.devices import device_kind
from kvgen.runtime.layout import Geometry
from kvgen.runtime.movers.base import Unsupported
from kvgen.runtime.movers.program import CopyProgram
from kvgen.runtime.ops import bits, placed
from kvgen.runtime.planes import plane_words
from kvgen.runtime.slots import Chunk
from kvgen.runtime.words import Words, words

#: Widest word a kernel moves: Triton has no 16-byte integer, and two 8-byte words per
#: thread already make 16-byte vector accesses.
KERNEL_WORD = 8
#: Words in one program's tile: enough bytes in flight per program, few registers spilled.
TILE_WORDS = 8192
_TABLES_KEPT = 16
#: A launch with fewer programs splits token rows into pieces (of no fewer words) until it
#: has this many: an H200 has 132 compute units, a Max 1550 128 (x 8 threads).
MIN_PROGRAMS, MIN_PIECE = 1024, 32
#: The largest alignment (in words) a kernel is told its leaf offsets have.
MAX_ALIGN = 16

#: Launches so far (tests use it to see that a kernel, not the torch path, moved the data).
stats = {"launches": 0, "fallbacks": 0}


#: Values of a launch that vary with the slots alone and take no branch of their own: where the
#: chunk's blocks and tokens start, the layer of a per-layer launch, and the extents and strides
#: (each kernel reads these as plain integers in the same instructions whatever their values);
#: and TA, the alignment of the leaves' offsets, which follows from where the allocator put the
#: leaves (it differs between two runs of one scenario) and is only a compiler hint.
_VALUES_ONLY = frozenset({"first_id", "first_slot", "block_start", "layer", "TA"})
_VALUE_PREFIXES = ("cs_", "os_", "E_")
#: The paths of the launches of a rehearsal (`rehearsed`), or None: launches run.
_rehearsal: set[tuple[Any, ...]] | None = None


def launch_path(fn: Any, args: dict[str, Any]) -> tuple[Any, ...]:
    """What decides which of a kernel's code one launch runs: the kernel, its constexpr and flag
    arguments, whether the grid has whole-block programs and token programs (and a last token
    tile that is partial), and each tensor's dtype, contiguity and 16-byte alignment. Two
    launches with one path run the same instructions on other slot values. VA, the rows'
    alignment, counts only as whether rows are rounded to it (VA > 1): its value follows from
    the leaves' addresses, as TA's does."""
    tile = int(args.get("TILE", 1))
    facts: list[tuple[Any, ...]] = []
    for name, value in sorted(args.items()):
        if isinstance(value, torch.Tensor):
            facts.append((name, str(value.dtype), value.is_contiguous(), value.data_ptr() % 16))
        elif name == "num_blocks":
            facts.append((name, value > 0))
        elif name == "num_tokens":
            facts.append((name, value > 0, value % tile != 0))
        elif name == "VA":
            facts.append((name, value > 1))
        elif name not in _VALUES_ONLY and not name.startswith(_VALUE_PREFIXES):
            facts.append((name, value))
    return (getattr(fn, "__name__", repr(fn)), id(fn), tuple(facts))


@contextmanager
def rehearsed() -> Iterator[set[tuple[Any, ...]]]:
    """Within it, a launch runs nothing and adds its `launch_path` to the set yielded: how
    `kvgen verify` finds, in Triton's interpreter (where each program instance runs in
    Python), the scenarios whose launches take a path no earlier scenario took. Not
    thread-safe: one rehearsal per process at a time."""
    global _rehearsal
    if _rehearsal is not None:
        raise RuntimeError("kernels.rehearsed() does not nest")
    _rehearsal = paths = set()
    try:
        yield paths
    finally:
        _rehearsal = None


def interpreting() -> bool:
    """Triton's interpreter is on: kernels run as numpy on the host, CPU tensors included."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_target() -> str | None:
    """The GPU backend Triton's active driver targets ("cuda", "hip", "xpu"), None without one."""
    try:
        import triton  # deferred: Triton is optional, needed only where a kernel may run

        return str(triton.runtime.driver.active.get_current_target().backend)
    except Exception:  # no driver, no device, a broken install: no kernels
        return None


def unavailable(device: torch.device) -> str | None:
    """Why the kernels cannot run on `device` here; None when they can."""
    if not triton_installed():
        return "triton is not installed (pip install 'kvgen[triton]')"
    if device.type == "cpu":
        return None if interpreting() else \
            "Triton runs on CPU tensors only in its interpreter (TRITON_INTERPRET=1, for tests)"
    if interpreting():  # the interpreter copies each argument to the host, not the leaves a table reaches
        return f"Triton's interpreter (TRITON_INTERPRET=1) runs kernels on CPU tensors only, not {device.type}"
    kind = device_kind(device.type)
    if kind is None or not kind.triton:
        return f"Triton has no backend for {device.type} devices"
    target = _triton_target()
    if target not in kind.triton:
        return f"Triton's active driver targets {target or 'no device'}, not {device.type}"
    return None


@dataclass(frozen=True)
class KernelSpec:
    """What a generated kernel expects besides its pointers, strides and extents: every launch
    fact that depends on the plan alone, decided by kvgen.plan.kernel at build time."""

    table: bool
    layerwise: bool
    #: Axes whose extents the kernel reads (E_<axis>), and the row's axes (R_<axis>).
    extents: tuple[str, ...]
    row: tuple[str, ...]
    #: Axes that grid axis 1 enumerates.
    outer: tuple[str, ...]
    #: Axes of the cache leaf and object views: their strides, by these names.
    cache_axes: tuple[str, ...]
    object_axes: tuple[str, ...]
    #: Programs of whole blocks step over BN = N slots per block (False: a folded slot axis, or
    #: a plane without slots: BN 1), and a token tile never spans more than a block.
    blocks: bool = True
    #: The most tokens one program moves per tile (1: a plane without slots, one row).
    tile: int = 64
    #: A plane without slots (a per-layer scale of a format-2 cache): one row per leaf.
    slotless: bool = False
    #: The kernel takes VA, the power of two (words) every token row starts at a multiple of;
    #: the axes (cache's, object's) whose strides place a row: VA divides each.
    aligned: bool = False
    cache_starts: tuple[str, ...] = ()
    object_starts: tuple[str, ...] = ()
    #: Views in the call's copy word (C counted in words), else as same-width integers.
    widen: bool = False
    #: A block slot split into two cache dims, (tile, place) (`N/8`, `N%8`): a slot's offset n
    #: in its block is at n // P tiles and n % P places, P the place's extent in the views.
    split: tuple[str, ...] = ()
    #: The kernel's name of each axis whose name is no identifier (`C/8`: C_t8), by axis.
    idents: tuple[tuple[str, str], ...] = ()

    def ident(self, axis: str) -> str:
        return dict(self.idents).get(axis, axis)


@dataclass(frozen=True)
class Step:
    """One move a mover hands a kernel: the direction, the object's tensor, the call (its frozen
    cache tree and geometry), the chunk, the layer of a per-layer object and the copy word."""

    store: bool
    tensor: torch.Tensor
    call: Any
    ck: Chunk
    layer: int | None
    w: Words


Views = Callable[[torch.Tensor, torch.Tensor, Geometry, Words, int], tuple[torch.Tensor, torch.Tensor]]

_dummies: dict[torch.device, torch.Tensor] = {}
_tables: dict[tuple[Any, ...], tuple[torch.Tensor, int]] = {}
_lock = threading.Lock()


def _dummy(device: torch.device) -> torch.Tensor:
    """A pointer argument for index tensors a chunk does not have (never read)."""
    t = _dummies.get(device)
    if t is None:
        t = _dummies.setdefault(device, torch.zeros(1, dtype=torch.int64, device=device))
    return t


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def leaf_words(w: Words, element: int, tensors: list[torch.Tensor], table: bool) -> Words:
    """The copy word for the kernel: at most 8 bytes, and one that divides the distance
    between cache leaves (the table counts in words). Unsupported for leaves whose strides
    differ: one set of strides addresses them all."""
    if any(t.stride() != tensors[0].stride() for t in tensors[1:]):
        raise Unsupported("cache tensors differ in strides")
    size = w.dtype.itemsize
    width = min(size, KERNEL_WORD)
    gaps = [t.data_ptr() - tensors[0].data_ptr() for t in tensors[1:]] if table else []
    while width > element and any(gap % width for gap in gaps):
        width //= 2
    if any(gap % width for gap in gaps):
        raise Unsupported("cache tensors lie apart by no whole number of elements")
    return w if width == size else words(width, element, w.C * size // element)


def _table(tensors: list[torch.Tensor], width: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Each leaf's offset from the first, in words, on the device (kept per cache), and the
    largest power of two up to 16 that divides every offset (the kernel's alignment hint)."""
    base = tensors[0].data_ptr()
    key = (device, width, tuple(t.data_ptr() for t in tensors))
    found = _tables.get(key)
    if found is None:
        offsets = [(t.data_ptr() - base) // width for t in tensors]
        common = math.gcd(*offsets) or MAX_ALIGN
        found = (torch.tensor(offsets, dtype=torch.int64, device=device), min(common & -common, MAX_ALIGN))
        with _lock:
            if len(_tables) >= _TABLES_KEPT:
                _tables.pop(next(iter(_tables)))
            _tables[key] = found
    return found


def _row_alignment(w: Words, table: int, strides: list[int]) -> int:
    """The largest power of two (in words, at most 16 bytes' worth) dividing the table's
    offsets and every stride that places a token's row: each row then starts at a multiple
    of it, which lets the compiler use vector accesses it cannot prove from the strides."""
    common = math.gcd(table, *strides)
    limit = max(1, 16 // w.dtype.itemsize)
    return min(common & -common, limit) if common else limit


@dataclass(frozen=True)
class Operands:
    """What one launch works on: the views of the first cache leaf (`x`) and of the object
    (`o`), every leaf of the cache (the table reaches them) and the cache's geometry."""

    x: torch.Tensor
    o: torch.Tensor
    leaves: list[torch.Tensor]
    g: Geometry
    #: The axes of `x`'s and of `o`'s dims.
    cache_axes: tuple[str, ...] = ()
    object_axes: tuple[str, ...] = ()

    def extent(self, axis: str) -> int:
        """An axis's extent: its dim in the views (so the kernel indexes only what they hold),
        else the geometry's (a list level of the cache)."""
        for axes, t in ((self.cache_axes, self.x), (self.object_axes, self.o)):
            if axis in axes:
                return int(t.shape[axes.index(axis)])
        return int(getattr(self.g, axis))


def _index_arguments(spec: KernelSpec, ck: Chunk, bn: int, dummy: torch.Tensor) -> dict[str, Any]:
    """The chunk's block ids, slots and token positions as the kernel takes them."""
    blocks = None if spec.slotless else ck.block_ids
    # A plane without slots is one token at slot 0 (its slot strides are 0).
    slots = slice(0, 1) if spec.slotless else ck.slots
    count = 0 if slots is None else (slots.stop - slots.start if isinstance(slots, slice) else slots.numel())
    tok = None if spec.slotless else ck.tok
    return dict(ids=blocks if isinstance(blocks, torch.Tensor) else dummy,
                first_id=blocks.start if isinstance(blocks, slice) else 0,
                IDS=isinstance(blocks, torch.Tensor), block_start=ck.block_start,
                num_blocks=ck.block_tokens // bn if blocks is not None else 0,
                slots=slots if isinstance(slots, torch.Tensor) else dummy,
                first_slot=slots.start if isinstance(slots, slice) else 0, SLOTS=isinstance(slots, torch.Tensor),
                tok=tok if tok is not None else dummy, TOK=tok is not None, num_tokens=count)


def _tile(spec: KernelSpec, width: int, bn: int) -> int:
    """Tokens per program tile: the plan's most, fewer for long rows (TILE_WORDS in flight),
    and never more than a block where programs step over blocks."""
    tile = max(1, min(spec.tile, TILE_WORDS // width))
    return min(tile, _pow2(bn)) if spec.blocks else tile


def _piece(width: int, programs: int, outer: int) -> int:
    """Words of a token's row one program moves: the whole row, split in halves (of at least
    MIN_PIECE words) while the launch has fewer than MIN_PROGRAMS programs."""
    piece = width
    while piece > MIN_PIECE and programs * outer * (width // piece) < MIN_PROGRAMS:
        piece //= 2  # few tokens and parts: split rows so that every compute unit has work
    return piece


def _starts(spec: KernelSpec, ops: Operands) -> list[int]:
    """The strides (in words) that place a token's row: the planned axes of each view, where
    their extent is above 1."""
    return [s for axes, names, t in ((spec.cache_axes, spec.cache_starts, ops.x),
                                     (spec.object_axes, spec.object_starts, ops.o))
            for a, s, n in zip(axes, t.stride(), t.shape, strict=True) if a in names and n > 1]


class Kernel:
    """One generated kernel and what launching it needs. `views`: the generated views of a
    plane of a format-2 cache (`views(tensor, leaf, g, w, num_tokens)`); None: the views come
    from the connector's PROGRAM (its cache and object places), as every mover's do."""

    def __init__(self, fn: Any, spec: KernelSpec, views: Views | None = None):
        self.fn, self.spec, self.views = fn, spec, views

    def __call__(self, program: CopyProgram, step: Step) -> None:
        """Move one chunk of `step.call` (of one layer, when layerwise) between `step.tensor`
        and the cache, at the places `program` gives every axis."""
        ck = step.ck
        if not ck.has_blocks and not ck.has_tokens:
            return
        cache_leaves = leaves(step.call.kvcaches)
        w = leaf_words(step.w, cache_leaves[0].element_size(), cache_leaves, self.spec.table)
        x, o = self.placed(program, step.tensor, cache_leaves[0], step.call.g, w)
        self.launch(*self.arguments(step, self.operands(x, o, cache_leaves, step.call.g), w))

    def placed(self, program: CopyProgram, tensor: torch.Tensor, leaf: torch.Tensor, g: Geometry, w: Words
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache leaf's and the object's views in the kernel's word, one dim per place."""
        def raw(t: torch.Tensor) -> torch.Tensor:
            return t.view(w.dtype) if self.spec.widen else bits(t)

        return placed(raw(leaf), program.cache_places, g), placed(raw(tensor), program.object_places, g)

    def operands(self, x: torch.Tensor, o: torch.Tensor, tensors: list[torch.Tensor], g: Geometry) -> Operands:
        if x.dim() != len(self.spec.cache_axes) or o.dim() != len(self.spec.object_axes):
            raise Unsupported(f"views of {x.dim()} and {o.dim()} dims for a kernel over "
                              f"{len(self.spec.cache_axes)} and {len(self.spec.object_axes)}")
        return Operands(x, o, tensors, g, self.spec.cache_axes, self.spec.object_axes)

    def arguments(self, step: Step, ops: Operands, w: Words) -> tuple[tuple[int, int], dict[str, Any], torch.device]:
        """(grid, arguments, device) of one launch over `ops`; Unsupported where the launch
        cannot be made."""
        spec, x, o = self.spec, ops.x, ops.o
        device = x.device
        args: dict[str, Any] = {"cache": x, "obj": o}
        if spec.table:
            args["table"], args["TA"] = _table(ops.leaves, w.dtype.itemsize, device)
        if spec.layerwise:
            args["layer"] = step.layer
        bn = int(ops.g.N or 1) if spec.blocks else 1
        if spec.split and math.prod(ops.extent(a) for a in spec.split) != bn:
            # a slot's offset below BN must reach a tile and a place inside the views
            raise Unsupported(f"a block's {' x '.join(spec.split)} slots in the views are not its {bn}")
        args.update(_index_arguments(spec, step.ck, bn, _dummy(device)))
        args.update({f"E_{spec.ident(a)}": ops.extent(a) for a in spec.extents})
        args.update({f"cs_{spec.ident(a)}": s for a, s in zip(spec.cache_axes, x.stride(), strict=True)})
        args.update({f"os_{spec.ident(a)}": s for a, s in zip(spec.object_axes, o.stride(), strict=True)})
        row = {f"R_{spec.ident(a)}": ops.extent(a) for a in spec.row}
        width = _pow2(math.prod(row.values()))
        tile = _tile(spec, width, bn)
        programs = args["num_blocks"] + -(-args["num_tokens"] // tile)
        outer = math.prod(ops.extent(a) for a in spec.outer)
        piece = _piece(width, programs, outer)
        args.update(row, ROW=width, RB=piece, BN=bn, TILE=tile, STORE=step.store)
        if spec.aligned:
            args["VA"] = _row_alignment(w, args.get("TA", MAX_ALIGN), _starts(spec, ops))
        grid = (programs, outer * (width // piece))
        if grid[1] > 65535:
            raise Unsupported(f"{grid[1]} outer parts exceed Triton's grid")
        return grid, args, device

    def launch(self, grid: tuple[int, int], args: dict[str, Any], device: torch.device) -> None:
        _launch(self.fn, grid, args, device)


def _launch(fn: Any, grid: tuple[int, int], args: dict[str, Any], device: torch.device) -> None:
    if _rehearsal is not None:
        _rehearsal.add(launch_path(fn, args))  # the grid follows from args
        return
    stats["launches"] += 1
    if device.type == "cpu" or device.index is None:
        fn[grid](**args)
        return
    with torch.get_device_module(device.type).device(device.index):
        fn[grid](**args)


Leaves = Callable[[Any, Geometry, int], list[torch.Tensor]]


class PlanesKernel:
    """The kernels of one format-2 connector, one per plane (kvgen.plan.kernel plans each as the
    format-1 kernel over the plane's byte views, which the twin writes; each axis is read at the
    place the plane's program in PROGRAM gives it there, as the native mover reads the module's
    byte views), launched like one `Kernel`: each plane moves
    as bytes in the widest word (at most 8 bytes) that this call's object and the cache allow
    for it (`runtime.plane_words`, the torch code's choice) and that divides the distance
    between its leaves, so one table of leaf offsets in words reaches every layer. Every
    plane's launch is prepared before the first runs: a cache the kernels cannot address
    raises Unsupported with nothing written."""

    def __init__(self, leaves: Leaves, rows: bool, planes: Sequence[Kernel]):
        #: `leaves(kvcaches, g, plane)`: every layer's leaf holding the plane, in layer order.
        self.leaves, self.rows, self.planes = leaves, rows, tuple(planes)

    def __call__(self, program: CopyProgram, step: Step) -> None:
        """Move one chunk (of one layer, when layerwise): every plane, one launch each."""
        ck, tensor = step.ck, step.tensor
        if not ck.has_blocks and not ck.has_tokens:
            return  # nothing moves, so neither do the planes without slots
        kvcaches, g = step.call.kvcaches, step.call.g
        wd = plane_words(g, tensor, self.rows)
        launches = []
        for i, kernel in enumerate(self.planes):
            tensors = self.leaves(kvcaches, g, i)
            pw = leaf_words(words(min(wd[i], KERNEL_WORD), 1, g.planes[i].C), 1, tensors, True)
            x, o = kernel.views(tensor, tensors[0], g, pw, ck.num_tokens)  # type: ignore[misc]
            if program.planes:  # each axis at the place the plane's program gives it in those views
                plane = program.planes[i]
                x, o = placed(x, plane.cache_places, g), placed(o, plane.object_places, g)
            launches.append((kernel, kernel.arguments(step, kernel.operands(x, o, tensors, g), pw)))
        for kernel, (grid, args, device) in launches:
            kernel.launch(grid, args, device)


class Refused:
    """The KERNEL of a connector no Triton kernel moves (its twin says why): the Triton mover
    refuses the connector when it prepares it, before anything is written."""

    def __init__(self, why: str):
        self.why = why

    def __call__(self, program: CopyProgram, step: Step) -> None:
        raise Unsupported(f"no Triton kernel: {self.why}")


_MODULES: dict[str, Any] = {}


def kernel_of(module: str) -> Kernel | PlanesKernel | Refused:
    """The Kernel of a connector module (its `_triton` twin), imported on first use.
    ModuleNotFoundError when the package was built without kernels."""
    found = _MODULES.get(module)
    if found is None:
        found = _MODULES.setdefault(module, importlib.import_module(f"{module}_triton").KERNEL)
    return found
