"""Transfer plans: how KV moves from a cache of one paged layout into a cache of another,
decided at build time, in one pass and without an intermediate object.

Both caches become canonical views (kvgen.plan.copy's `canonical`: one dim per axis). The
container levels of either side (a list per layer, a (K, V) pair) become loops, and an axis
that one side keeps in a list and the other in a tensor dim is selected from the tensor. What
is left on both sides is the same set of axes (L?, KV?, H?, C plus the slot axes), in two
orders:

* block path: whole blocks that map onto whole blocks (same block size, aligned pairs of
  slots, found per call by kvgen.runtime.transfer.pairs) move by one index op over B on each side,
  the source view permuted into the destination's dim order;
* token path: every other token is gathered from the source by its slot (`x[blk, off]`, or
  rows of a folded slot axis) and put at its destination slot, the gathered tensor permuted
  from the order torch gives the source index into the order of the destination index.

Head ranges (`src_heads`, `dst_heads`) narrow the H dim of each view. When both sides end in
C, values move as wide integer words. String and tuple work only; torch is never imported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvgen.plan import splits
from kvgen.plan.code import COLUMNS, INDENT, Method, assign_chain
from kvgen.plan.copy import (
    LOOP_VARS,
    SLOT,
    Loop,
    View,
    canonical,
    ends_in_c,
    index_suffix,
    indexed_order,
    permute_suffix,
    select,
)
from kvgen.plan.geometry import geometry_body, planes_geometry_body
from kvgen.plan.layouts import Fields, layout_fields
from kvgen.plan.program import ProgramPlan, transfer_program
from kvgen.spec.model import Spec
from kvgen.spec.transfers import TransferPair

#: Parameters of the generated copy methods, after `self` (and `layer`).
COPY_PARAMS = ("call: runtime.TransferCall",)
#: What a copy may work with: the name its lines use -> the field of the TransferCall.
CALL_FIELDS = (("src_caches", "src"), ("dst_caches", "dst"), ("gs", "gs"), ("gd", "gd"), ("p", "pairs"),
               ("w", "words"))


def unpack(lines: list[str]) -> str:
    """The first statement of a copy: the call's fields its `lines` use, under their names."""
    used = [(name, attr) for name, attr in CALL_FIELDS if any(re.search(rf"\b{name}\b", line) for line in lines)]
    return f"{', '.join(n for n, _ in used)} = {', '.join(f'call.{a}' for _, a in used)}"
#: Extents of the geometry of each side, by the name the generated code gives it.
AXES = ("L", "KV", "H", "C", "N")


@dataclass(frozen=True)
class TransferPlan:
    """One generated transfer module."""

    pair: TransferPair
    #: True when both sides end in C, so copies may move C as wide integer words.
    widen: bool
    #: The container loops of a whole copy, outermost first (L first when either side lists it).
    loops: tuple[Loop, ...]
    #: Both sides address whole blocks (B and N dims), so a call may take the block path.
    blocks: bool
    src_fields: Fields
    dst_fields: Fields
    #: Bodies of `read_src_geometry` / `read_dst_geometry`.
    src_geometry: tuple[str, ...]
    dst_geometry: tuple[str, ...]
    methods: tuple[Method, ...]
    #: The compiled kernel's description of this pair (kvgen.plan.program), rendered as PROGRAM.
    program: ProgramPlan

    @property
    def src(self) -> Spec:
        return self.pair.src

    @property
    def dst(self) -> Spec:
        return self.pair.dst

    @property
    def module(self) -> str:
        return self.pair.module

    @property
    def sources(self) -> tuple[Spec, ...]:
        return (self.src,) if self.src is self.dst else (self.src, self.dst)

    @property
    def strategy(self) -> str:
        """One line for people: what the generated copy does."""
        loops = " x ".join(lp.axis for lp in self.loops)
        per = f"per {loops}" if loops else "all layers at once"
        how = "whole blocks by index over B, the other tokens by slot" if self.blocks else "tokens by slot"
        return f"{per}: {how}" + ("; wide words" if self.widen else "")


def _loops(src: Spec, dst: Spec, layerwise: bool) -> tuple[Loop, ...]:
    """Axes either side keeps in containers; the layer first. A layerwise copy fixes L itself."""
    listed = dict.fromkeys(a for a in ("L", "KV") if a in src.lists or a in dst.lists)
    if layerwise:
        listed.pop("L", None)
    return tuple(Loop(LOOP_VARS[a], a, f"gs.{a}") for a in listed)


def _group(spec: Spec, side: str) -> str:
    """The size of a head group of `spec` as the generated copy reads it from that side's geometry."""
    return splits.factor_expr(spec.head_groups[1], "gs" if side == "src" else "gd")


def _view(spec: Spec, side: str, fixed: dict[str, str], widen: bool, other: tuple[Spec, str]) -> View:
    """The canonical view of one side's leaf inside the loops, its heads narrowed to the call's
    range; where either side groups its heads (`H/g`, `H%g`), H as the same tile and place."""
    geometry = "gs" if side == "src" else "gd"
    extent = {a: f"{geometry}.{a}" for a in AXES}
    if widen:
        extent["C"] = "w.C"
    leaf = f"{side}_caches" + "".join(f"[{fixed[a]}]" for a in spec.lists)
    raw = f"{leaf}.view(w.dtype)" if widen else f"runtime.bits({leaf})"
    view = select(canonical(raw, spec.dims, extent), fixed)
    split = spec.head_groups
    if split:  # whole groups (the runtime checks the ranges): the tile narrowed by the group size
        at, group = view.axes.index(split[0]), _group(spec, side)
        return View(f"{view.expr}.narrow({at}, p.{side}_h // {group}, p.heads // {group})", view.axes)
    if "H" in view.axes:
        at = view.axes.index("H")
        view = View(f"{view.expr}.narrow({at}, p.{side}_h, p.heads)", view.axes)
        grouped = other[0].head_groups
        if grouped:  # the other side's heads in groups: these as the same tile and place
            axes = (*view.axes[:at], *grouped, *view.axes[at + 1:])
            view = View(f"{view.expr}.unflatten({at}, (-1, {_group(other[0], other[1])}))", axes)
    return view


def _token_index(view: View, side: str) -> tuple[str, tuple[str, ...]]:
    """The index suffix picking the call's tokens on one side, and the dims of the result."""
    slots = (SLOT,) if SLOT in view.axes else ("B", "N")
    names = {SLOT: f"p.{side}_slots", "B": f"p.{side}_blk", "N": f"p.{side}_off"}
    return index_suffix(view.axes, {a: names[a] for a in slots}), indexed_order(view.axes, slots)


def _token_copy(x: View, y: View) -> list[str]:
    """The token path: gather `v` from x, put it into y. A folded slot axis is one index over
    one dim: rows move by index_select / index_copy_ (a plain copy for consecutive slots);
    blocks and offsets index two dims at once, as one merged dim where the strides allow."""
    src_index, src_order = _token_index(x, "src")
    dst_index, dst_order = _token_index(y, "dst")
    if SLOT in x.axes:
        value = f"runtime.pick(x, {x.axes.index(SLOT)}, p.src_slots, p.scratch)"
    elif _adjacent(x):  # B then N: one index over both when the strides let them merge
        value = f"runtime.pick_slots(x, {x.axes.index('B')}, p.src, p.scratch)"
    else:
        value = f"x{src_index}"
    gather = f"v = runtime.carry({value}{permute_suffix(src_order, dst_order)}, y)  # {_axes(dst_order)}"
    if SLOT in y.axes:
        put = f"runtime.put_index(y, {y.axes.index(SLOT)}, p.dst_slots, v)"
    elif _adjacent(y):
        put = f"runtime.put_slots(y, {y.axes.index('B')}, p.dst, v)"
    else:
        put = f"y{dst_index} = v"
    return ["if p.has_tokens:  # single tokens by slot", f"{INDENT}{gather}", f"{INDENT}{put}"]


def _commented(lines: list[str], view: View) -> list[str]:
    """A view's assignment with its dims said on its last line."""
    return [*lines[:-1], f"{lines[-1]}  # {_axes(view.axes)}"]


def _fit(lines: list[str], indent: int = 8) -> list[str]:
    """Lines as placed `indent` deep in a method: a trailing comment that would pass 120
    characters goes on a line of its own above its statement."""
    out = []
    for line in lines:
        code, sep, comment = line.partition("  # ")
        if sep and indent + len(line) > 120:
            out += [f"{code[:len(code) - len(code.lstrip())]}# {comment}", code]
        else:
            out.append(line)
    return out


def _blocks_of(view: View, name: str) -> tuple[str, tuple[str, ...]]:
    """A side as blocks: a folded slot axis split into (blocks, slots in a block) of the other
    side's block size (`p.block`; the runtime takes this path only when it divides the slots)."""
    if SLOT not in view.axes:
        return name, view.axes
    i = view.axes.index(SLOT)
    return f"{name}.unflatten({i}, (-1, p.block))", (*view.axes[:i], "B", "N", *view.axes[i + 1:])


def _adjacent(view: View) -> bool:
    return "B" in view.axes and view.axes.index("N") == view.axes.index("B") + 1


def _axes(axes: tuple[str, ...]) -> str:
    return f"[{' '.join(axes)}]"


def copy_body(src: Spec, dst: Spec, widen: bool, layerwise: bool) -> tuple[str, ...]:
    """The statements of `_copy` (every layer) or `_copy_layer` (one layer, `layer`)."""
    loops = _loops(src, dst, layerwise)
    fixed = {lp.axis: lp.var for lp in loops}
    if layerwise:
        fixed["L"] = "layer"
    x, y = _view(src, "src", fixed, widen, (dst, "dst")), _view(dst, "dst", fixed, widen, (src, "src"))
    width = COLUMNS - 8 - len(INDENT) * len(loops)  # what a line of the loops' body has
    inner = [*_commented(assign_chain("x", x.expr, width), x), *_commented(assign_chain("y", y.expr, width), y)]
    if SLOT not in x.axes or SLOT not in y.axes:
        (xe, xa), (ye, ya) = _blocks_of(x, "x"), _blocks_of(y, "y")
        order = ", ".join(str(xa.index(a)) for a in ya)
        inner += ["if p.has_blocks:  # whole blocks onto whole blocks, x's blocks in y's dim order",
                  f"{INDENT}runtime.move_blocks(({xe}, {xa.index('B')}, p.src_blocks),",
                  f"{INDENT}                    ({ye}, {ya.index('B')}, p.dst_blocks), ({order}), p.scratch)"]
    inner += _token_copy(x, y)
    head = [INDENT * i + f"for {lp.var} in range({lp.extent}):" for i, lp in enumerate(loops)]
    body = [*head, *(INDENT * len(loops) + line for line in inner)]
    return tuple(_fit([unpack(body), *body]))


def plan_transfer(pair: TransferPair) -> TransferPlan:
    src, dst = pair.src, pair.dst
    widen = ends_in_c(src) and ends_in_c(dst)
    blocks = not any(d.is_slot for d in src.dims) or not any(d.is_slot for d in dst.dims)
    methods = (Method("_copy", COPY_PARAMS, copy_body(src, dst, widen, layerwise=False)),
               Method("_copy_layer", ("layer: int", *COPY_PARAMS), copy_body(src, dst, widen, layerwise=True)))
    return TransferPlan(pair, widen, _loops(src, dst, False), blocks, layout_fields(src), layout_fields(dst),
                        ("PAGED = SRC", *_geometry(src)), ("PAGED = DST", *_geometry(dst)), methods,
                        transfer_program(src, dst))


def _geometry(spec: Spec) -> tuple[str, ...]:
    """The body of a side's read_geometry: a tiled tree's reads its tile and place (and the group size)."""
    return geometry_body(spec) if spec.is_simple else planes_geometry_body(spec)


def plan_transfers(pairs: tuple[TransferPair, ...]) -> tuple[TransferPlan, ...]:
    return tuple(plan_transfer(p) for p in pairs)
