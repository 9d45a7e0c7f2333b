"""Copy plans of format-2 pairs: a cache made of several parts or typed fields, and an
object that packs its planes (rows or regions).

A *plane* is a part, or one field of a part (kvgen.spec.model.Plane). Each plane is planned
as a format-1 copy of its own (kvgen.plan.copy.make_plan with a `Source`): its cache leaf
and its object view are byte views (a plane's C is the bytes of one value row), so planes of
any dtype, fields at byte offsets in a row and fields laid out per block all reuse the same
block path and token path. A plane without a slot axis (a per-layer scale) is copied whole
with every chunk that moves a token.

Objects:
* rows: each token's row is every plane's bytes, one after another in plane order (LMCache's
  flat MLA plane: KV_MLA_FMT of the summed width, in the cache's first dtype);
* regions: bytes, per layer each plane as a dense region laid out by the object's dims with
  the axes the plane lacks left out, each region at a multiple of 16 bytes.

No torch here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvgen.plan import splits
from kvgen.plan.copy import EXTENT, LOOP_VARS, CopyPlan, Mode, Source, make_plan, mode_of
from kvgen.spec.model import PART_LEVEL, Dim, FieldsIn, Pack, Plane, Spec
from kvgen.spec.passes.parts import part_view

#: The tokens of the chunk inside a copy method, and in `_shape`.
TOKENS = {"copy": "ck.num_tokens", "shape": "num_tokens"}


@dataclass(frozen=True)
class PlaneCopy:
    """One plane's copy: its format-1 plan over byte views."""

    plane: Plane
    copy: CopyPlan

    @property
    def slotless(self) -> bool:
        return not self.plane.has_slots


@dataclass(frozen=True)
class PlanesPlan:
    """A connector of a format-2 pair: the planes' copies and what they share. It answers
    to the same names as a CopyPlan where tools read them (paged, obj, mode, module,
    strategy, widen)."""

    paged: Spec
    obj: Spec
    mode: Mode
    planes: tuple[PlaneCopy, ...]
    #: Statements every copy method starts with (the object's byte view, region starts).
    preamble: tuple[str, ...]
    #: Object shape, as expressions over `g` and `num_tokens`.
    shape: tuple[str, ...]
    #: The object's dtype as an expression; None: the cache's (first part's) dtype.
    dtype: str | None
    widen: bool = False
    #: Regions objects: each plane's region bytes per layer, over `g` and `num_tokens`.
    sizes: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        return f"{self.paged.name}__{self.obj.name}"

    @property
    def tiled(self) -> bool:
        """A cache with split axes (format 3 tiles): its planes move on the torch path only (kvgen.plan.splits)."""
        return any(splits.is_tiled(pc.plane.part) for pc in self.planes)

    @property
    def strategy(self) -> str:
        names = ", ".join(pc.plane.name for pc in self.planes)
        per = "per layer" if self.mode is Mode.LAYERWISE else "all layers"
        return f"{counted(len(self.planes), 'plane')} ({names}) as bytes, {per}, into {self.obj.pack}"


def counted(n: int, noun: str) -> str:
    """`1 plane`, `2 planes`: a count for people (a connector's strategy, its kernels' summary)."""
    return f"{n} {noun}{'s' if n != 1 else ''}"


def compatible_planes(paged: Spec, obj: Spec) -> bool:
    """A format-2 cache and a packed object whose dims can hold every plane."""
    if not paged.is_paged or obj.is_paged or paged.is_simple or obj.pack in (None, Pack.GROUPS):
        return False  # a groups object pairs with a model (kvgen.plan.models)
    if obj.lists not in ((), ("L",)):
        return False
    if paged.token_ratio != (1, 1):
        return False  # format 3 token ratios: the reference addresses them; no connector yet
    if any(splits.is_tiled(p) for p in paged.parts) and obj.pack is not Pack.REGIONS:
        return False  # a tiled plane is moved value by value, into a region of its own (kvgen.plan.splits)
    return all(_plane_fits(plane, obj) for plane in paged.moved_planes())


def _plane_fits(plane: Plane, obj: Spec) -> bool:
    """Whether a packed object's dims hold one plane: every layer, and in rows only slot-wise
    planes of C values, in regions only the axes the object has."""
    need = set(plane.axes) | {"C"}
    if "L" not in need:
        return False
    if obj.pack is Pack.ROWS and (not plane.has_slots or need - {"L", "C"}):
        return False
    return not (obj.pack is Pack.REGIONS and need - (set(obj.axes) - {"T"}))


def _cache_dims(plane: Plane) -> tuple[tuple[Dim, ...], str]:
    """The part's dims over its byte view, and how a leaf becomes that view. A part without
    C gets a trailing byte dim (its value's bytes)."""
    part, f = plane.part, plane.field
    if splits.is_tiled(part):  # each value's bytes a trailing dim: the innermost dim need not be C
        return (*part.dims, Dim((splits.ELEMENT,))), "runtime.bytes_of({}.unsqueeze(-1))"
    if f is not None:
        if part.fields_in is FieldsIn.ROW and part.dims[-1].axes == ("KV", "C"):
            # Format 3: K's C then V's, each holding the fields; the field is a plane with KV.
            dims = (*part.dims[:-1], Dim(("KV",)), Dim(("C",)))
            return dims, f"runtime.kv_row_field({{}}, {f.offset}, {f.nbytes})"
        if part.fields_in is FieldsIn.ROW:
            return part.dims, f"runtime.row_field({{}}, {f.offset}, {f.nbytes})"
        run = part.block_run
        if len(run) == 2:
            return part.dims, f"runtime.block_field({{}}, {f.offset}, {f.nbytes}, g.N)"
        # Format 3: a run of every head's (and each K and V side's) cells; a fused [KV, H] is
        # split so the plane has KV and H dims of its own.
        head = part.dims[:len(part.dims) - len(run)]
        if tuple(d.axes for d in run) == (("N",), ("KV", "H"), ("C",)):
            # Slot-major cells with the sides outermost in the run (vLLM NVFP4 under NHD): the
            # run's bytes are [KV N H C], so the plane has those dims.
            dims = (*head, Dim(("KV",)), Dim(("N",)), Dim(("H",)), Dim(("C",)))
            return dims, f"runtime.slot_cell_field({{}}, {f.offset}, {f.nbytes})"
        dims = (*head, *(Dim((a,)) for d in run for a in d.axes))
        sides = run[0].axes == ("KV", "H")
        return dims, f"runtime.cell_field({{}}, {f.offset}, {f.nbytes}, {sides})"
    if part.has("C"):
        return part.dims, "runtime.bytes_of({})"
    return (*part.dims, Dim(("C",))), "runtime.bytes_of({}.unsqueeze(-1))"


def _extent(axis: str, index: int, tokens: str) -> str:
    if axis == "T":
        return tokens
    return f"g.planes[{index}].C" if axis == "C" else EXTENT[axis]  # regions are cut in bytes


def _region_dims(obj: Spec, plane: Plane) -> tuple[Dim, ...]:
    """The object's dims with what the plane lacks left out (and L, which holds regions)."""
    keep = set(plane.axes) | {"C"} | ({"T"} if plane.has_slots else set())
    out = []
    for d in obj.dims:
        axes = tuple(a for a in d.axes if a in keep and a != "L")
        if axes:
            out.append(Dim(axes))
    return tuple(out)


def _region_size(dims: tuple[Dim, ...], index: int, tokens: str) -> str:
    return " * ".join(_extent(a, index, tokens) for d in dims for a in d.axes)


def plan_planes(paged: Spec, obj: Spec) -> PlanesPlan:
    if not compatible_planes(paged, obj):
        raise ValueError(f"{paged.name} and {obj.name} do not hold the same planes")
    mode = mode_of(obj)
    planes = paged.moved_planes()
    whole = mode is Mode.WHOLE
    preamble = ["rows = runtime.bytes_of(tensor)",
                f"wd = runtime.plane_words(g, tensor, {obj.pack is Pack.ROWS})  # each plane's word this call"]
    if obj.pack is Pack.REGIONS:
        preamble.append("at = runtime.region_starts(self._sizes(g, ck.num_tokens))  # each region in a layer")
    shape, dtype, sizes = _object_shape(obj, planes, whole)
    copies = tuple(_plane_copy(paged, obj, i, plane, whole) for i, plane in enumerate(planes))
    return PlanesPlan(paged, obj, mode, copies, tuple(preamble), shape, dtype, sizes=sizes)


def _object_shape(obj: Spec, planes: tuple[Plane, ...],
                  whole: bool) -> tuple[tuple[str, ...], str | None, tuple[str, ...]]:
    """A fresh object's shape and dtype (None: the cache's), and for regions each plane's region size."""
    if obj.pack is Pack.REGIONS:
        sizes = tuple(_region_size(_region_dims(obj, p), i, TOKENS["shape"]) for i, p in enumerate(planes))
        shape = (*(("g.L",) if whole else ()), "runtime.region_bytes(self._sizes(g, num_tokens))")
        return shape, "torch.uint8", sizes
    shape = tuple("1" if d.is_singleton else ("num_tokens" if d.axes == ("T",) else
                                              ("runtime.units(g.row_bytes, g.dtype)" if d.axes == ("C",)
                                               else EXTENT[d.axes[0]])) for d in obj.dims)
    return shape, None, ()


#: Why a cache of planes listed by another level than its parts and layers (a one-tree cache listed
#: by KV, say) has no compiled program and no Triton kernel: both reach every layer's leaf of a
#: plane by one step over L.
LIST_LEVELS_REASON = "list levels other than the parts P and the layers L"


def tensor_layer_dim(paged: Spec) -> int | None:
    """The dim of L in the tensors of a cache that holds its layers there, not in a list level (a
    one-tree cache such as SGLang's page_unified host pool), where L is a dim of its own at one place
    in every part; None otherwise. Such a cache is moved as a list over L of the tensors' layer slices,
    so every mover reaches a layer as it reaches a leaf of a list."""
    if "L" in paged.lists:
        return None
    places = {tuple(j for j, d in enumerate(p.dims) if d.axes == ("L",)) for p in paged.parts}
    return places.pop()[0] if len(places) == 1 and len(next(iter(places))) == 1 else None


def leaf_source(paged: Spec, plane: int | str) -> str:
    """The expression of one layer's leaf holding part `plane` inside a copy's layer loop:
    `kvcaches[plane][layer]` down the list levels, a layer slice where the tensors hold L."""
    leaf = "kvcaches" + "".join(f"[{plane}]" if a == PART_LEVEL else f"[{LOOP_VARS[a]}]" for a in paged.lists)
    at = tensor_layer_dim(paged)
    return leaf if at is None else f"{leaf}.select({at}, layer)"


def _plane_copy(paged: Spec, obj: Spec, i: int, plane: Plane, whole: bool) -> PlaneCopy:
    """Plane `i` moved as a format-1 copy between its byte view of the cache and its place in the object."""
    dims, raw = _cache_dims(plane)
    view = dataclasses.replace(part_view(paged, plane.part), dims=dims)
    at = tensor_layer_dim(paged)
    if at is not None:  # each layer's slice a leaf of a list over L
        view = dataclasses.replace(view, lists=("L", *view.lists), dims=(*dims[:at], *dims[at + 1:]))
    leaf = leaf_source(paged, plane.index)
    extent = {**EXTENT, "C": f"(g.planes[{i}].C // wd[{i}])"}
    if obj.pack is Pack.REGIONS:
        odims = _region_dims(obj, plane)
        shape_i = ", ".join(" * ".join(_extent(a, i, TOKENS["copy"]) for a in d.axes) for d in odims)
        one = "," if len(odims) == 1 else ""
        tensor = f"runtime.region(rows, {1 if whole else 0}, at[{i}], ({shape_i}{one}), wd[{i}])"
        if splits.is_tiled(plane.part):  # the dense region viewed as the tiled part's dims
            odims, extent = splits.object_dims(plane.part, odims), {**EXTENT, **splits.extents(plane.part, i)}
        odims = ((Dim(("L",)),) if whole else ()) + odims
    else:
        odims = obj.dims
        tensor = f"rows.narrow({len(odims) - 1}, g.plane_start({i}), g.planes[{i}].C)"
    ospec = dataclasses.replace(obj, dims=odims, pack=None)
    # Both sides move in the plane's word of this call: C counts words.
    raw = f"runtime.as_words({raw}, wd[{i}])"
    if obj.pack is Pack.ROWS:
        tensor = f"runtime.as_words({tensor}, wd[{i}])"
    source = Source(leaf, tensor, extent, raw)
    return PlaneCopy(plane, make_plan(view, ospec, source))
