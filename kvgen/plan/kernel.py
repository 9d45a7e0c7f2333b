"""Kernel plans: the Triton kernel of one connector, derived from its copy plan.

The torch path moves a chunk with one or more ops per layer; the kernel moves every layer
of a chunk in one launch (one per layer for per-layer objects, whose protocol steps the
layers). Its grid is (whole blocks + token tiles, outer parts):

* grid axis 1 enumerates the *outer* axes, the values (L, KV, H) that do not belong to a
  token's row; a cache that is a list of tensors reaches each leaf through a device table
  of leaf offsets, a cache that is one tensor through its strides (one stacked view);
* a token's *row* is the longest run of value axes that both sides keep in the same order
  at their end (e.g. [H C] for NHD caches and [T H C] objects, [C] for HND), moved as one
  vector of copy words;
* grid axis 0 moves the chunk's whole blocks (addresses from the block id alone, so the
  rows of a block are contiguous where the cache keeps them so) and then its remaining
  tokens by slot, slots < 0 masked (`kvgen.runtime.tiles.move_chunk`).

Everything here is string work; the kernel module imports Triton, the generator never does.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgen.plan.copy import EXTENT, SLOT, CopyPlan, Mode, View, canonical
from kvgen.spec.model import Spec

#: Coordinate variable of each value axis inside a kernel.
COORD = {"L": "layer", "KV": "kv", "H": "h", "C": "c"}


@dataclass(frozen=True)
class KernelPlan:
    copy: CopyPlan
    #: Canonical view of one cache leaf (`leaf`), and of the object tensor (`tensor`).
    leaf: View
    obj: View
    #: The cache's list levels: the kernel reaches its leaves through a table when any.
    lists: tuple[str, ...]
    #: Slot axes of the leaf: ("B", "N"), or ("S",) for a folded slot axis.
    slot: tuple[str, ...]
    row: tuple[str, ...]
    outer: tuple[str, ...]
    #: Axes whose extents the kernel reads at run time (`E_<axis>`).
    extents: tuple[str, ...]
    #: The kernel's parameters and body (unindented lines).
    params: tuple[str, ...]
    body: tuple[str, ...]
    #: Body of the module's `_views(tensor, leaf, g, w)`.
    views: tuple[str, ...]

    @property
    def module(self) -> str:
        return f"{self.copy.module}_triton"

    @property
    def layerwise(self) -> bool:
        return self.copy.mode is Mode.LAYERWISE

    @property
    def sources(self) -> tuple[Spec, Spec]:
        return (self.copy.paged, self.copy.obj)

    @property
    def decorator(self) -> str:
        # A layer index of 1 must stay a run-time value: the kernel widens it to 64 bits.
        return '@triton.jit(do_not_specialize=("layer",))' if self.layerwise else "@triton.jit"

    @property
    def summary(self) -> tuple[str, str]:
        """For people: what a launch covers, and how it reaches the cache."""
        parts = " x ".join(self.outer) or "1"
        where = f"leaves by a table over {' x '.join(self.lists)}" if self.lists else "one stacked cache tensor"
        per = "one launch per layer and chunk" if self.layerwise else "one launch per chunk"
        return f"{per}, grid (whole blocks + token tiles, {parts})", f"rows [{' '.join(self.row)}]; {where}"

    @property
    def grid(self) -> str:
        return "; ".join(self.summary)

    @property
    def spec_fields(self) -> tuple[tuple[str, object], ...]:
        """The fields of the module's `kernels.KernelSpec`."""
        return (("table", bool(self.lists)), ("folded", self.slot == (SLOT,)), ("layerwise", self.layerwise),
                ("extents", self.extents), ("row", self.row), ("outer", self.outer), ("cache_axes", self.leaf.axes),
                ("object_axes", self.obj.axes))


def _common_suffix(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return a[len(a) - n:]


def _table_index(lists: tuple[str, ...]) -> str:
    """The leaf's index in tree order: kvcaches[kv][layer] is kv * E_L + layer."""
    index = COORD[lists[0]]
    for axis in lists[1:]:
        index = f"({index}) * E_{axis} + {COORD[axis]}" if "*" in index else f"{index} * E_{axis} + {COORD[axis]}"
    return index


def _offsets(axes: tuple[str, ...], prefix: str) -> str:
    terms = [f"{COORD[a]} * {prefix}_{a}" for a in axes]
    return " + ".join(terms) if terms else "0"


def kernel_text(layerwise: bool, leaf: View, obj: View, lists: tuple[str, ...], slot: tuple[str, ...],
                aligned: bool = False) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The kernel's parameters and body (its row, outer and extent axes: kernel_axes). `slot`
    () is a plane without slots (a per-layer scale): its one row moves as a single token at
    slot 0 with every slot stride 0. `aligned`: the launch passes VA, the power of two every
    token row starts at a multiple of."""
    row, outer, extents = kernel_axes(leaf, obj, lists, slot, layerwise)
    params = ["cache", "obj", *(["table"] if lists else []), "ids", "slots", "tok",
              *(["layer"] if layerwise else []), "first_id", "first_slot", "block_start", "num_blocks",
              "num_tokens", *(f"E_{a}" for a in extents), *(f"cs_{a}" for a in leaf.axes),
              *(f"os_{a}" for a in obj.axes), *(f"R_{a}: tl.constexpr" for a in row),
              *(["TA: tl.constexpr"] if lists else []),
              *(f"{c}: tl.constexpr" for c in ("ROW", "RB", "BN", "TILE", "IDS", "SLOTS", "TOK", "STORE")),
              *(["VA: tl.constexpr"] if aligned else [])]
    # Grid axis 1: the outer part, and which RB-word piece of a token's row (a launch with
    # few tokens and parts still fills the device).
    body = ["q = tl.program_id(1)",
            f"j = (q % (ROW // RB)) * RB + tl.arange(0, RB)  # words of one token's row: [{' '.join(row)}]"]
    if outer:
        body.append("q = (q // (ROW // RB)).to(tl.int64)  # the outer part: " + " x ".join(outer))
        for axis in reversed(outer[1:]):
            body += [f"{COORD[axis]} = q % E_{axis}", f"q = q // E_{axis}"]
        body.append(f"{COORD[outer[0]]} = q")
    if layerwise:
        body.append("layer = layer.to(tl.int64)")
    in_leaf = tuple(a for a in leaf.axes if a not in slot and a not in row)
    c_base = _offsets(in_leaf, "cs")
    if lists:
        # TA: a power of two dividing every leaf's offset, so the compiler may use vector accesses.
        leaf = f"tl.multiple_of(tl.load(table + {_table_index(lists)}), TA)"
        c_base = leaf if c_base == "0" else f"{leaf} + {c_base}"
    o_outer = tuple(a for a in obj.axes if a != "T" and a not in row)
    body += ["# where this part starts in the cache and in the object, in words",
             f"c_base = {c_base}", f"o_base = {_offsets(o_outer, 'os')}"]
    for axis in reversed(row[1:]):
        body += [f"{COORD[axis]} = j % R_{axis}", f"j = j // R_{axis}"]
    if row:
        body += [f"{COORD[row[0]]} = j", f"row_mask = {COORD[row[0]]} < R_{row[0]}"]
    else:
        body.append("row_mask = j < 1")
    body.append(f"c_row = {_offsets(row, 'cs')}")
    body.append(f"o_row = {_offsets(row, 'os')}")
    slot_strides = "cs_S, 0" if slot == (SLOT,) else "cs_B, cs_N" if slot else "0, 0"
    body += ["move_chunk(cache, obj, c_base, o_base, c_row, o_row, row_mask,",
             "           ids, slots, tok, first_id, first_slot, block_start, num_blocks, num_tokens,",
             f"           {slot_strides}, {'os_T' if slot else '0'}, BN, TILE, IDS, SLOTS, TOK, STORE"
             + (", VA)" if aligned else ")")]
    return tuple(params), tuple(body)


def kernel_axes(leaf: View, obj: View, lists: tuple[str, ...], slot: tuple[str, ...], layerwise: bool
                ) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(row, outer, extents) of a kernel over canonical `leaf` and `obj` views: the row is
    what both keep last in one order, outer every other value (the object's order first)."""
    fixed = {"L"} if layerwise else set()
    cache_values = tuple(a for a in leaf.axes if a not in slot and a not in fixed)
    obj_values = tuple(a for a in obj.axes if a != "T")
    row = _common_suffix(cache_values, obj_values)
    values = (*lists, *cache_values)
    outer = tuple(a for a in obj_values if a not in row and a not in fixed)
    outer += tuple(a for a in values if a not in outer and a not in row and a not in fixed)
    extents = tuple(dict.fromkeys([*outer[1:], *lists[1:]]))
    return row, outer, extents


def make_kernel_plan(plan: CopyPlan) -> KernelPlan:
    paged = plan.paged
    raw = "{}.view(w.dtype)" if plan.widen else "runtime.bits({})"
    extent = {**EXTENT, "C": "w.C"} if plan.widen else EXTENT
    leaf = canonical(raw.format("leaf"), paged.dims, extent)
    obj = plan.object_view
    slot = (SLOT,) if SLOT in leaf.axes else ("B", "N")
    layerwise = plan.mode is Mode.LAYERWISE
    row, outer, extents = kernel_axes(leaf, obj, paged.lists, slot, layerwise)
    params, body = kernel_text(layerwise, leaf, obj, paged.lists, slot)
    views = (f"x = {leaf.expr}  # one cache leaf: [{' '.join(leaf.axes)}]",
             f"o = {obj.expr}  # the object: [{' '.join(obj.axes)}]",
             "return x, o")
    return KernelPlan(plan, leaf, obj, paged.lists, slot, row, outer, extents, params, body, views)
