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

A format-2 cache (several planes: parts, or typed fields of a part, each planned by
kvgen.plan.planes as a format-1 copy over byte views) gets the same kernel per plane, over the
plane's views, with its bytes moved in the widest word its offsets and strides allow at run
time: one launch per plane, every layer's leaf of the plane reached through a table. A plane
without slots (a per-layer scale) is one row per layer, moved whole as a single token at slot
0 with every chunk that moves a token, as the torch code does.

Every launch fact that depends on the plan alone is decided here and written into the
twin's `KernelSpec` (kvgen.runtime.kernels): the row and outer axes, whether programs step
over whole blocks, the most tokens per tile, the axes whose strides a row's alignment
divides. A format-1 kernel's views are the connector's PROGRAM places (the launch makes
them), a plane's the byte views written here.

Everything here is string work; the kernel module imports Triton, the generator never does.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgen.plan import splits
from kvgen.plan.code import assign_chain
from kvgen.plan.copy import SLOT, CopyPlan, Mode, View, canonical
from kvgen.plan.planes import LIST_LEVELS_REASON, PlaneCopy, PlanesPlan, counted, leaf_source, tensor_layer_dim
from kvgen.spec.elements import split_of
from kvgen.spec.model import PART_LEVEL, Pack, Spec

#: The most tokens one program moves per tile (a plane without slots moves one row).
MAX_TILE = 64

#: Coordinate variable of each value axis inside a kernel.
COORD = {"L": "layer", "KV": "kv", "H": "h", "C": "c"}


def ident(axis: str) -> str:
    """An axis as part of a kernel's names: a split axis's tile `C/8` is C_t8, its place `C%8` C_p8."""
    split = split_of(axis)
    if split is None:
        return axis
    base, op, factor = split
    return f"{base}_{'t' if op == '/' else 'p'}{factor}"


def coord(axis: str) -> str:
    """The coordinate variable of a value axis (a split axis's and a value's words `E` lower-cased)."""
    return COORD.get(axis) or ident(axis).lower()


@dataclass(frozen=True)
class Axes:
    """How one kernel sees its copy: the canonical cache leaf and object views, the cache's
    list levels (reached through a table when any), the leaf's slot axes (("B", "N"), ("S",)
    for a folded slot axis, () for a plane without slots) and whether L is the launch's."""

    leaf: View
    obj: View
    lists: tuple[str, ...]
    slot: tuple[str, ...]
    layerwise: bool

    @property
    def split(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """(row, outer, extents): the row is what both views keep last in one order, outer
        every other value (the object's order first), extents what the kernel reads."""
        return kernel_axes(self.leaf, self.obj, self.lists, self.slot, self.layerwise)


def launch_fields(axes: Axes, aligned: bool) -> tuple[tuple[str, object], ...]:
    """The `kernels.KernelSpec` fields of a kernel over `axes`: every launch fact the plan
    alone decides (the launch reads only extents, strides and addresses besides)."""
    row, outer, extents = axes.split
    slotless = not axes.slot
    fields: tuple[tuple[str, object], ...] = (
        ("table", bool(axes.lists)), ("layerwise", axes.layerwise), ("extents", extents), ("row", row),
        ("outer", outer), ("cache_axes", axes.leaf.axes), ("object_axes", axes.obj.axes),
        ("blocks", axes.slot[:1] == ("B",)), ("tile", 1 if slotless else MAX_TILE), ("slotless", slotless))
    if len(axes.slot) == 3:  # a block slot split into a tile and a place: their strides address a slot
        fields += (("split", axes.slot[1:]),)
    names = tuple((a, ident(a)) for a in (*axes.leaf.axes, *axes.obj.axes) if ident(a) != a)
    if names:
        fields += (("idents", tuple(dict.fromkeys(names))),)
    if aligned:  # every stride that places a token's row, on both sides: VA divides them
        fields += (("aligned", True), ("cache_starts", tuple(a for a in axes.leaf.axes if a not in row)),
                   ("object_starts", tuple(a for a in axes.obj.axes if a not in row)))
    return fields


class OnAxes:
    """What a kernel plan reads off its Axes: the cache leaf's and the object's views and the
    slot axes (a kernel plan and a plane's kernel plan share them)."""

    axes: Axes

    @property
    def leaf(self) -> View:
        return self.axes.leaf

    @property
    def obj(self) -> View:
        return self.axes.obj

    @property
    def slot(self) -> tuple[str, ...]:
        return self.axes.slot


@dataclass(frozen=True)
class KernelPlan(OnAxes):
    copy: CopyPlan
    axes: Axes
    row: tuple[str, ...]
    outer: tuple[str, ...]
    #: The kernel's parameters and body (unindented lines).
    params: tuple[str, ...]
    body: tuple[str, ...]

    @property
    def lists(self) -> tuple[str, ...]:
        return self.axes.lists

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
        return _decorator(self.layerwise)

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
        """The fields of the module's `kernels.KernelSpec`: the launch facts, and the word the
        views (made from the connector's PROGRAM places) are in."""
        return (*launch_fields(self.axes, False), ("widen", self.copy.widen))


def _decorator(layerwise: bool) -> str:
    # A layer index of 1 must stay a run-time value: the kernel widens it to 64 bits.
    return '@triton.jit(do_not_specialize=("layer",))' if layerwise else "@triton.jit"


def _common_suffix(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return a[len(a) - n:]


def _table_index(lists: tuple[str, ...]) -> str:
    """The leaf's index in tree order: kvcaches[kv][layer] is kv * E_L + layer."""
    index = coord(lists[0])
    for axis in lists[1:]:
        index = f"({index}) * E_{axis} + {coord(axis)}" if "*" in index else f"{index} * E_{axis} + {coord(axis)}"
    return index


def _offsets(axes: tuple[str, ...], prefix: str) -> str:
    terms = [f"{coord(a)} * {prefix}_{ident(a)}" for a in axes]
    return " + ".join(terms) if terms else "0"


def _params(axes: Axes, aligned: bool) -> list[str]:
    """The kernel's parameters: pointers, the chunk's indices, extents, strides, constexprs."""
    row, _, extents = axes.split
    lists, layerwise = axes.lists, axes.layerwise
    return ["cache", "obj", *(["table"] if lists else []), "ids", "slots", "tok",
            *(["layer"] if layerwise else []), "first_id", "first_slot", "block_start", "num_blocks",
            "num_tokens", *(f"E_{ident(a)}" for a in extents), *(f"cs_{ident(a)}" for a in axes.leaf.axes),
            *(f"os_{ident(a)}" for a in axes.obj.axes), *(f"R_{ident(a)}: tl.constexpr" for a in row),
            *(["TA: tl.constexpr"] if lists else []),
            *(f"{c}: tl.constexpr" for c in ("ROW", "RB", "BN", "TILE", "IDS", "SLOTS", "TOK", "STORE")),
            *(["VA: tl.constexpr"] if aligned else [])]


def _outer_lines(row: tuple[str, ...], outer: tuple[str, ...], layerwise: bool) -> list[str]:
    """Grid axis 1: the outer part, and which RB-word piece of a token's row (a launch with
    few tokens and parts still fills the device)."""
    lines = ["q = tl.program_id(1)",
             f"j = (q % (ROW // RB)) * RB + tl.arange(0, RB)  # words of one token's row: [{' '.join(row)}]"]
    if outer:
        lines.append("q = (q // (ROW // RB)).to(tl.int64)  # the outer part: " + " x ".join(outer))
        for axis in reversed(outer[1:]):
            lines += [f"{coord(axis)} = q % E_{ident(axis)}", f"q = q // E_{ident(axis)}"]
        lines.append(f"{coord(outer[0])} = q")
    if layerwise:
        lines.append("layer = layer.to(tl.int64)")
    return lines


def _base_lines(axes: Axes, row: tuple[str, ...]) -> list[str]:
    """Where the program's part starts in the cache (through the table, when the cache is a
    list) and in the object, in words."""
    in_leaf = tuple(a for a in axes.leaf.axes if a not in axes.slot and a not in row)
    c_base = _offsets(in_leaf, "cs")
    if axes.lists:
        # TA: a power of two dividing every leaf's offset, so the compiler may use vector accesses.
        leaf = f"tl.multiple_of(tl.load(table + {_table_index(axes.lists)}), TA)"
        c_base = leaf if c_base == "0" else f"{leaf} + {c_base}"
    o_outer = tuple(a for a in axes.obj.axes if a != "T" and a not in row)
    return ["# where this part starts in the cache and in the object, in words",
            f"c_base = {c_base}", f"o_base = {_offsets(o_outer, 'os')}"]


def _row_lines(row: tuple[str, ...]) -> list[str]:
    """The coordinates of the words of one token's row, and their offsets on each side."""
    lines: list[str] = []
    for axis in reversed(row[1:]):
        lines += [f"{coord(axis)} = j % R_{ident(axis)}", f"j = j // R_{ident(axis)}"]
    if row:
        lines += [f"{coord(row[0])} = j", f"row_mask = {coord(row[0])} < R_{ident(row[0])}"]
    else:
        lines.append("row_mask = j < 1")
    return [*lines, f"c_row = {_offsets(row, 'cs')}", f"o_row = {_offsets(row, 'os')}"]


def _move_lines(slot: tuple[str, ...], aligned: bool) -> list[str]:
    """The call of the shared tile mover: the pointers, the part's starts and row, the chunk's
    indices, the cache's slot strides and the object's token stride (a block slot split into a
    tile and a place, `N/8` and `N%8`: then the place's stride and extent), then the constexprs."""
    slot_strides = "cs_S, 0" if slot == (SLOT,) else f"cs_B, cs_{ident(slot[1])}" if slot else "0, 0"
    steps = f"{slot_strides}, {'os_T' if slot else '0'}"
    if len(slot) == 3:
        steps += f", cs_{ident(slot[2])}, E_{ident(slot[2])}"
    return ["move_chunk((cache, obj), (c_base, o_base, c_row, o_row, row_mask),",
            "           (ids, slots, tok, first_id, first_slot, block_start, num_blocks, num_tokens),",
            f"           ({steps}), (BN, TILE, {'VA' if aligned else '1'}), (IDS, SLOTS, TOK, STORE))"]


def kernel_text(axes: Axes, aligned: bool = False) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The kernel's parameters and body. A plane without slots (`axes.slot` ()) moves its one
    row as a single token at slot 0 with every slot stride 0. `aligned`: the launch passes VA,
    the power of two every token row starts at a multiple of."""
    row, outer, _ = axes.split
    body = [*_outer_lines(row, outer, axes.layerwise), *_base_lines(axes, row), *_row_lines(row),
            *_move_lines(axes.slot, aligned)]
    return tuple(_params(axes, aligned)), tuple(body)


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
    # A split block slot's place: a slot's offset in its block splits by its extent.
    extents = tuple(dict.fromkeys([*outer[1:], *lists[1:], *slot[2:]]))
    return row, outer, extents


def make_kernel_plan(plan: CopyPlan) -> KernelPlan:
    """The kernel of a format-1 connector: its views are the connector's PROGRAM places, in the
    call's word (C in words) where the copy widens, else as same-width integers."""
    paged = plan.paged
    leaf = View("leaf", canonical("leaf", paged.dims).axes)
    obj = View("tensor", canonical("tensor", plan.obj.dims).axes)
    slot = (SLOT,) if SLOT in leaf.axes else ("B", "N")
    axes = Axes(leaf, obj, paged.lists, slot, plan.mode is Mode.LAYERWISE)
    row, outer, _ = axes.split
    params, body = kernel_text(axes)
    return KernelPlan(plan, axes, row, outer, params, body)


# -- caches of several planes (spec format 2): one kernel per plane ------------------------------------------------

@dataclass(frozen=True)
class PlaneKernelPlan(OnAxes):
    """The kernel of one plane: its views, its axes and its text."""

    index: int
    name: str
    axes: Axes
    params: tuple[str, ...]
    body: tuple[str, ...]
    #: Body of the module's `_views_<name>(tensor, leaf, g, w, num_tokens)`.
    views: tuple[str, ...]

    @property
    def slotless(self) -> bool:
        return not self.axes.slot

    @property
    def row(self) -> tuple[str, ...]:
        return self.axes.split[0]

    @property
    def outer(self) -> tuple[str, ...]:
        return self.axes.split[1]

    @property
    def ident(self) -> str:
        """The plane's suffix in the module's function names: its index, since a plane's
        name comes from a spec and must never become code."""
        return str(self.index)

    @property
    def spec_fields(self) -> tuple[tuple[str, object], ...]:
        """The fields of this plane's `kernels.KernelSpec`."""
        return launch_fields(self.axes, True)

    @property
    def summary(self) -> str:
        what = "no slots: one row per layer" if self.slotless else f"rows [{' '.join(self.row)}]"
        if len(self.slot) == 3:
            what += f", block slots split as {' x '.join(self.slot[1:])}"
        return f"{self.name}: {what}" + (f", outer {' x '.join(self.outer)}" if self.outer else "")


@dataclass(frozen=True)
class PlanesKernelPlan:
    """The Triton kernels of one format-2 connector, one per plane, in plane order."""

    copy: PlanesPlan
    planes: tuple[PlaneKernelPlan, ...]
    #: Body of the module's `_leaves(kvcaches, g, plane)`: every layer's leaf of one plane.
    leaves: str

    @property
    def module(self) -> str:
        return f"{self.copy.module}_triton"

    @property
    def sizes(self) -> tuple[str, ...]:
        """A regions object's region bytes per layer, over `g` and `num_tokens` (() for rows)."""
        return self.copy.sizes

    @property
    def layerwise(self) -> bool:
        return self.copy.mode is Mode.LAYERWISE

    @property
    def rows(self) -> bool:
        return self.copy.obj.pack is Pack.ROWS

    @property
    def sources(self) -> tuple[Spec, Spec]:
        return (self.copy.paged, self.copy.obj)

    @property
    def decorator(self) -> str:
        return _decorator(self.layerwise)

    @property
    def summary(self) -> tuple[str, str]:
        """For people: what a chunk costs, and how the kernels reach the cache."""
        per = "per layer and chunk" if self.layerwise else "per chunk"
        return (f"one launch per plane {per} ({counted(len(self.planes), 'plane')}), grid (whole blocks + token "
                "tiles, outer)",
                "leaves by a table over L; " + "; ".join(p.summary for p in self.planes))

    @property
    def grid(self) -> str:
        return "; ".join(self.summary)


def _rewrite(expr: str, i: int, swaps: dict[str, str]) -> str:
    """A torch-copy view expression of plane `i` in the kernel's terms: the word of the
    kernel's own call (`w`) for the plane's word of the torch call (`wd[i]`)."""
    swaps = {f"(g.planes[{i}].C // wd[{i}])": "w.C", f"wd[{i}]": "w.dtype.itemsize", **swaps}
    for old, new in swaps.items():
        expr = expr.replace(old, new)
    return expr


def _plane_kernel(plan: PlanesPlan, pc: PlaneCopy, index: int) -> PlaneKernelPlan:
    copy, layerwise = pc.copy, plan.mode is Mode.LAYERWISE
    source = leaf_source(plan.paged, pc.plane.index)
    if source not in copy.cache_view.expr:
        raise ValueError(f"{plan.module}: plane {pc.plane.name}'s cache view does not read {source}")
    leaf = View(_rewrite(copy.cache_view.expr, index, {source: "leaf"}), copy.cache_view.axes)
    obj = View(_rewrite(copy.object_view.expr, index, {"ck.num_tokens": "num_tokens"}), copy.object_view.axes)
    left = [name for name in ("wd[", "ck.", "kvcaches") if name in leaf.expr + obj.expr]
    if left:  # the torch copy's views name something the kernel's views do not have
        raise ValueError(f"{plan.module}: plane {pc.plane.name}'s views still use {', '.join(left)}")
    slot = () if pc.slotless else (SLOT,) if SLOT in leaf.axes else ("B", *(splits.slot_split(leaf.axes) or ("N",)))
    axes = Axes(leaf, obj, ("L",), slot, layerwise)
    params, body = kernel_text(axes, aligned=True)
    views = ["rows = runtime.bytes_of(tensor)"]
    if plan.sizes:
        views.append("at = runtime.region_starts(_region_sizes(g, num_tokens))  # each region in a layer")
    views += [f"# this plane of one cache leaf: [{' '.join(leaf.axes)}], and of the object: [{' '.join(obj.axes)}]",
              *assign_chain("x", leaf.expr), *assign_chain("o", obj.expr), "return x, o"]
    return PlaneKernelPlan(index, pc.plane.name, axes, params, body, tuple(views))


@dataclass(frozen=True)
class RefusedKernelPlan:
    """The twin of a connector no Triton kernel moves yet: its KERNEL says why
    (`kernels.Refused`), and the Triton mover refuses the connector before anything moves."""

    copy: PlanesPlan
    why: str

    @property
    def module(self) -> str:
        return f"{self.copy.module}_triton"

    @property
    def sources(self) -> tuple[Spec, Spec]:
        return (self.copy.paged, self.copy.obj)

    @property
    def grid(self) -> str:
        """For people, in place of a launch grid: that there is no kernel, and why."""
        return f"no Triton kernel: {self.why}"


def make_planes_kernel_plan(plan: PlanesPlan) -> PlanesKernelPlan | RefusedKernelPlan:
    why = plan_refusal(plan)
    if why is not None:
        return RefusedKernelPlan(plan, why)
    planes = tuple(_plane_kernel(plan, pc, i) for i, pc in enumerate(plan.planes))
    return PlanesKernelPlan(plan, planes, f"[{leaf_source(plan.paged, 'plane')} for layer in range(g.L)]")


#: Why a plane whose block slot splits into a tile or a place without the other has no kernel: a
#: slot's offset in its block is addressed as tile x place, by the place's extent.
PARTIAL_SLOT_REASON = "a block slot split into a tile without its place (or a place without its tile)"


def plan_refusal(plan: object) -> str | None:
    """Why a connector's plan has no Triton kernel (its twin's KERNEL refuses), or None. A split
    C or H is two dims of a plane's row, a split block slot N two slot dims (tile and place)."""
    if not isinstance(plan, PlanesPlan):
        return None
    if any(a not in (PART_LEVEL, "L") for a in plan.paged.lists):
        return LIST_LEVELS_REASON
    holds_l = "L" not in plan.paged.lists and any(p.has("L") for p in plan.paged.parts)
    if holds_l and tensor_layer_dim(plan.paged) is None:
        return LAYER_DIM_REASON
    return next((why for pc in plan.planes if (why := slot_refusal(pc.copy.cache_view.axes)) is not None), None)


#: Why a cache whose tensors hold L, but not as one dim at one place in every part, has no kernel:
#: a layer's leaf is the slice of that dim (kvgen.plan.planes.tensor_layer_dim).
LAYER_DIM_REASON = "L is not a dim of its own at one place in every part"


def slot_refusal(cache_axes: tuple[str, ...]) -> str | None:
    """Why a plane's cache view has no kernel's block slot: N split into a tile without its place
    or a place without its tile (the spec's passes refuse such a spec; the kernel needs both)."""
    n = [a for a in cache_axes if (split_of(a) or ("",))[0] == "N"]
    return PARTIAL_SLOT_REASON if n and not splits.slot_split(cache_axes) else None


def kernel_grid(plan: object) -> str | None:
    """The launch grid of a connector's kernel, for people; None for anything that is not a
    connector's plan (a connector with no kernel says so, plan_refusal)."""
    if isinstance(plan, PlanesPlan):
        return make_planes_kernel_plan(plan).grid
    return make_kernel_plan(plan).grid if isinstance(plan, CopyPlan) else None
