"""The copy description of a connector (its PROGRAM), decided at build time from the layouts.

Everything about a copy that does not depend on the live tensors is decided here, once, and
written into the generated module as `PROGRAM = runtime.CopyProgram(...)`
(kvgen.runtime.movers.program): where every axis lives on each side (tensor dim, or a list
level of the cache), the token paths (whole blocks by id then single tokens by slot, or
tokens by slot over a folded slot axis), the dims of each kernel call per direction (the
object's order for both), a block slot split into two cache dims (tile and place, `N/8` and
`N%8`: the object's tokens viewed as tile x place, a single token's offset split by the
kernel), which of the innermost dims both layouts keep adjacent (so they may merge into one
memcpy run), and, for a pair the compiled kernel cannot move, the reason.

Movers (kvgen.runtime.movers) execute the description with the live extents, strides and
addresses only; none of them reads the layout facts to decide anything.

String and tuple work on specs; torch is never imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgen.plan import splits
from kvgen.plan.code import COLUMNS, chain_calls
from kvgen.plan.copy import CopyPlan, Mode
from kvgen.plan.planes import LIST_LEVELS_REASON, PlanesPlan
from kvgen.spec.model import Spec

#: The most dims one call of the compiled kernel takes (KV_MAXD in kvgen/runtime/csrc/kvcopy.c;
#: tests check the two agree).
KERNEL_DIMS = 8
#: Axes that address tokens: the cache's block, slot in block and folded slot, the object's token.
TOKEN_AXES = frozenset({"B", "N", "S", "T"})

Fields = tuple[tuple[str, Any], ...]
Place = tuple[str, int, tuple[str, ...]]


@dataclass(frozen=True)
class ProgramPlan:
    """A connector's PROGRAM: the CopyProgram's fields and each CopyPath's, ready to render."""

    fields: Fields
    paths: tuple[Fields, ...]
    #: A cache of several planes: each plane's program.
    planes: tuple[ProgramPlan, ...] = ()

    @property
    def compiled(self) -> str | None:
        return dict(self.fields)["compiled"]


def places(spec: Spec) -> tuple[Place, ...]:
    """(axis, tensor dim, axes after it in that dim) for every axis of a leaf, outermost first;
    a folded slot dim [B N] is S, singleton dims hold none."""
    out: list[Place] = []
    for i, dim in enumerate(spec.dims):
        if dim.is_slot:
            out.append(("S", i, ()))
            continue
        out.extend((a, i, dim.axes[k + 1:]) for k, a in enumerate(dim.axes))
    return tuple(out)


def _why_not(shared: tuple[str, ...], cache: tuple[str, ...], lists: tuple[str, ...], obj: tuple[str, ...],
             slotless: bool, slot: tuple[str, ...]) -> str | None:
    """Why the compiled kernel cannot move this copy (layout facts only); None when it can.
    `slot`: the cache dims of a block slot (N, or N's tile and place)."""
    for a in shared:
        if a not in cache and a not in lists:
            return f"axis {a} is on the object only"
        if a not in obj:
            return f"axis {a} is on the cache only"
    if not slotless and ("T" not in obj or ("S" not in cache and ("B" not in cache or not slot))):
        return "token axes not found"
    if len(shared) + 1 + len(slot) > KERNEL_DIMS:
        return f"{len(shared) + 1 + len(slot)} dims exceed the kernel's {KERNEL_DIMS}"
    return None


#: One side of a copy as `_run` reads it: its leaf's axes in order, its list levels, and the
#: axis of its own that the dim N (slots of whole blocks) steps along.
Side = tuple[tuple[str, ...], tuple[str, ...], str]


def _run(order: tuple[str, ...], sides: tuple[Side, ...], units: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """The innermost dims of `order` that every side keeps adjacent and innermost, so that
    with contiguous strides they are one run: each is, on every side, the axis right before
    the one merged before it (the last axis of the leaf, for the first). N merges as each
    side's slot axis; indexed dims (B, T), list levels and axes of one side only (a block slot's
    tile and place) never. `units`: axes the spec fixes at 1 (an indexer's H), which take no
    room on either side and are no dim of a kernel call, so they never stand between two
    others (a [B, 1, N, C] block's N and C are one run)."""
    order, sides = _without(units, order, sides)
    merged: list[str] = []
    inner = [len(axes) for axes, _, _ in sides]
    for name in reversed(order):
        if name in ("B", "T") or any(name in lists or (name != "N" and name not in axes) for axes, lists, _ in sides):
            break
        at = [axes.index(n_axis if name == "N" else name) for axes, _, n_axis in sides]
        if any(a != i - 1 for a, i in zip(at, inner, strict=True)):
            break
        merged.append(name)
        inner = at
    return tuple(reversed(merged))


def _without(units: frozenset[str], order: tuple[str, ...], sides: tuple[Side, ...]
             ) -> tuple[tuple[str, ...], tuple[Side, ...]]:
    """`order` and each side's axes with the axes of `units` left out."""
    kept = tuple(a for a in order if a not in units)
    return kept, tuple((tuple(a for a in axes if a not in units), lists, n_axis) for axes, lists, n_axis in sides)


def _order(dims: tuple[str, ...], key: dict[str, tuple[int, int]]) -> tuple[str, ...]:
    return tuple(sorted(dims, key=lambda d: key[d]))


def program_plan(plan: CopyPlan | PlanesPlan) -> ProgramPlan:
    """The PROGRAM of one connector (of each plane, for a cache of several)."""
    if isinstance(plan, PlanesPlan):
        return planes_program(plan)
    if [a for a in plan.obj.lists if a != "L"]:
        return ProgramPlan((("compiled", f"object list levels {plan.obj.lists}"),), ())
    return copy_program(places(plan.paged), plan.paged.lists, places(plan.obj), plan.mode is Mode.LAYERWISE,
                        units=unit_axes(plan.paged))


def unit_axes(spec: Spec) -> frozenset[str]:
    """The axes a cache's spec fixes at 1 (checked by its module's read_geometry)."""
    return frozenset(a for a, n in spec.sizes if n == 1)


def copy_program(cp: tuple[Place, ...], lists: tuple[str, ...], op: tuple[Place, ...], layerwise: bool,
                 slotless: bool = False, units: frozenset[str] = frozenset()) -> ProgramPlan:
    """The program of one copy from where its axes live: the cache leaf's places and list
    levels, the object's places; `slotless`: a plane without slots (copied whole with every
    chunk that moves a token, one path `plane`); `units`: axes fixed at 1 (`_run`)."""
    cache, objs = tuple(p[0] for p in cp), tuple(p[0] for p in op)
    split = splits.slot_split(cache)
    slot = split or tuple(a for a in ("N",) if a in cache)
    axes = (set(cache) | set(lists) | set(objs)) - TOKEN_AXES - set(split) - ({"L"} if layerwise else set())
    shared = tuple(sorted(axes))
    folded = "S" in cache
    fields: Fields = (("compiled", _why_not(shared, cache, lists, objs, slotless, slot)), ("layerwise", layerwise),
                      ("folded", folded), ("slotless", slotless), ("cache_lists", lists), ("cache_places", cp),
                      ("object_places", op), ("shared", shared))
    if split:  # only where N is split: every other module's PROGRAM reads as before
        fields += (("slot_split", split),)
    if dict(fields)["compiled"] is not None:
        return ProgramPlan(fields, ())
    if slotless:
        names: tuple[tuple[str, tuple[str, ...]], ...] = (("plane", shared),)
    else:
        names = ((("blocks", ("B", *slot, *shared)),) if not folded else ()) + (("tokens", ("T", *shared)),)
    okey, ckey = _object_key(objs, shared, slot, slotless), _cache_key(cache, lists, shared, slot)
    sides: tuple[Side, ...] = ((cache, lists, "N"), (objs, (), "T"))
    paths = []
    for name, dims in names:
        store, load = _order(dims, ckey), _order(dims, okey)
        paths.append((("name", name), ("store", store), ("load", load),
                      ("store_run", _run(store, sides, units)), ("load_run", _run(load, sides, units))))
    return ProgramPlan(fields, tuple(paths))


# Each direction walks the order of the side it reads, which it reads front to back: a load the
# object's (_object_key), a store the cache's (_cache_key), as transfers walk their source's.
# Reads a stride apart stall the walk until each line arrives; writes a stride apart do not. A
# load that walked the cache's order read the object in pieces of one token's K or V, a stride
# apart, and took 1.3-1.7x as long on the CPU (vLLM and SGLang layouts, per-layer objects, 2048
# tokens, 2 vCPUs shared with other jobs; the bare kernel 2x at 256 and 2048 tokens). A store
# that walked the object's order read the cache a head's stride apart: x memcpy at 2048 tokens,
# one build with only the PROGRAM's store order swapped, three runs of each in turn, NVFP4 pages
# 0.51-0.64 then 0.64-0.73 in the cache's order, int8 per token and head 0.57-0.67 then
# 0.68-0.79, HND per layer 0.72-0.79 then 0.94-0.98, HND whole 0.96-1.13 then 1.14-1.22
# (benchmarks/RESULTS.md, "Stores walk the cache's order").


def _object_key(objs: tuple[str, ...], shared: tuple[str, ...], slot: tuple[str, ...],
                slotless: bool) -> dict[str, tuple[int, int]]:
    """Each dim's place in the object: B and N at the token's place, blocks outside slots, a
    split N's tile outside its place (the object's tokens of a block viewed as tile x place)."""
    key = {a: (objs.index(a), 0) for a in shared}
    if not slotless:
        t = objs.index("T")
        key.update(B=(t, 0), T=(t, 0), **{a: (t, 1 + k) for k, a in enumerate(slot)})
    return key


def planes_program(plan: PlanesPlan) -> ProgramPlan:
    """A cache of several planes: one program per plane over the byte views the module's
    `_planes` makes (the object's region or row slice of the plane, and the plane's leaf of
    every layer), each plane's axes one dim per axis in those views: the mover reads every
    axis's extent from its dim there, a tile's and a place's too (a split axis has no extent in
    the geometry)."""
    if any(tuple(lp.axis for lp in pc.copy.loops) != ("L",) for pc in plan.planes):
        return ProgramPlan((("compiled", LIST_LEVELS_REASON),), ())
    layerwise = plan.mode is Mode.LAYERWISE
    planes = []
    for pc in plan.planes:
        cp = tuple((a, i, ()) for i, a in enumerate(pc.copy.cache_view.axes))
        op = tuple((a, i, ()) for i, a in enumerate(pc.copy.object_view.axes))
        planes.append(copy_program(cp, ("L",), op, layerwise, pc.slotless, unit_axes(plan.paged)))
    why = next((p.compiled for p in planes if p.compiled is not None), None)
    return ProgramPlan((("compiled", why),), (), tuple(planes) if why is None else ())


def planes_views(plan: PlanesPlan) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The bodies of a format-2 module's `_plane_objects(tensor, g, ck)` (each plane's view of
    the object) and `_plane_leaves(kvcaches, g)` (each plane's leaf of every layer), as bytes:
    the generated copies' views with a word of one byte (the compiled kernel merges contiguous
    bytes into runs itself)."""
    objects = [line for line in plan.preamble if not line.startswith("wd = ")]
    objects.insert(1, "wd = (1,) * len(g.planes)  # bytes")
    objects.append("return (")
    for pc in plan.planes:  # each plane's comment on a line of its own: views can be long
        objects += [f"    # plane {pc.plane.name}: {' '.join(pc.copy.object_view.axes)}",
                    *_continued(pc.copy.object_view.expr)]
    objects.append(")")
    leaves = ["wd = (1,) * len(g.planes)  # bytes", "return ("]
    for pc in plan.planes:
        leaves += [f"    # plane {pc.plane.name}: {' '.join(pc.copy.cache_view.axes)}",
                   f"    tuple({pc.copy.cache_view.expr}",
                   "          for layer in range(g.L)),"]
    leaves.append(")")
    return tuple(objects), tuple(leaves)


def _continued(expr: str) -> list[str]:
    """One entry of a tuple display: `expr,`, a chain of calls too long for a line (of a method
    body's tuple, at column 12) continued a call a line inside the parentheses."""
    if len(expr) <= COLUMNS - 13:  # 12 columns of indent, then the comma
        return [f"    {expr},"]
    parts = chain_calls(expr)
    return [f"    {parts[0]}", *(f"        {p}" for p in parts[1:-1]), f"        {parts[-1]},"]


def _cache_key(cache: tuple[str, ...], lists: tuple[str, ...], shared: tuple[str, ...],
               slot: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Each dim's place in a cache: its list levels first, then its leaf's axes; a block and a
    single token at its block (or folded slot) axis, a block slot's axes (`slot`) at their own,
    N just inside a folded slot."""
    def at(axis: str) -> tuple[int, int]:
        return (lists.index(axis), 0) if axis in lists else (len(lists) + cache.index(axis), 0)

    key = {a: at(a) for a in (*shared, *slot)}
    block = "S" if "S" in cache else "B"
    if block in cache:  # else a plane without slots
        key["B"] = key["T"] = at(block)
    if block == "S":
        key["N"] = (at(block)[0], 1)
    return key


def _grouped_heads(sides: tuple[Place, ...], group: tuple[str, ...]) -> tuple[Place, ...]:
    """A side's places with a whole H seen as the other side's head groups: the tile outer, the
    place inner, in H's dim (its stride the group's size of H's). A split side keeps its own."""
    if not group:
        return sides
    tile, place = group
    out: list[Place] = []
    for axis, dim, inner in sides:
        out += [(tile, dim, (place, *inner)), (place, dim, inner)] if axis == "H" else [(axis, dim, inner)]
    return tuple(out)


def transfer_program(src: Spec, dst: Spec) -> ProgramPlan:
    """The PROGRAM of a layout-to-layout transfer (runtime.TransferProgram): both caches'
    places, the shared axes, and per path the dims of a whole call and of a layer's call in
    the source's order with the innermost that may merge into the run."""
    group = src.head_groups or dst.head_groups  # a one-tree cache of head groups: both sides see them
    sp, dp = (_grouped_heads(places(s), group) for s in (src, dst))
    sa, da = tuple(p[0] for p in sp), tuple(p[0] for p in dp)
    src_axes, dst_axes = set(sa) | set(src.lists), set(da) | set(dst.lists)
    shared = tuple(sorted((src_axes | dst_axes) - TOKEN_AXES))
    one_side = [a for a in shared if (a in src_axes) != (a in dst_axes)]
    why = f"axis {one_side[0]} is on one side only" if one_side else None
    fields: Fields = (("compiled", why), ("src_lists", src.lists), ("src_places", sp), ("dst_lists", dst.lists),
                      ("dst_places", dp), ("shared", shared))
    if why is not None:
        return ProgramPlan(fields, ())
    # The source's order: each source leaf is read front to back. Walking the destination's
    # order instead took 1.1-1.4x as long on a quiet 2-vCPU host (2048 tokens, L=32, whole: vLLM
    # HND -> NHD 1.12x, NHD -> HiCache page-first 1.32x, whose layers it read from 32 leaves at
    # once; per layer 1.18x and 1.0x).
    key = _cache_key(sa, src.lists, shared, ("N",) if "N" in sa else ())
    sides: tuple[Side, ...] = ((sa, src.lists, "S" if "S" in sa else "N"), (da, dst.lists, "S" if "S" in da else "N"))
    paths = []
    for name, dims in (("blocks", ("B", "N", *shared)), ("tokens", ("T", *shared))):
        whole = _order(dims, key)
        layer = tuple(d for d in whole if d != "L")
        paths.append((("name", name), ("whole", whole), ("layer", layer), ("whole_run", _run(whole, sides)),
                      ("layer_run", _run(layer, sides))))
    return ProgramPlan(fields, tuple(paths))
