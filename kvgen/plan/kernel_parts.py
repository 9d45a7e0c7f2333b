"""Kernel plans of format-2 connectors: one Triton kernel per plane, from the PartsPlan.

A format-2 cache is several planes (parts, or typed fields of a part), each planned by
kvgen.plan.parts as a format-1 copy over byte views. The kernel of each plane is the
format-1 kernel (kvgen.plan.kernel) over the same views, with the plane's bytes moved in
the widest word the plane's offsets and strides allow at run time (`w`), so a chunk costs
one launch per plane: every layer's leaf of the plane is reached through a device table of
leaf offsets. A plane without slots (a per-layer scale) is one row per layer, moved whole
as a single token at slot 0 with every chunk that moves a token, as the torch code does.

String work only: the generated module imports Triton, the generator never does.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgen.plan.copy import LOOP_VARS, SLOT, CopyPlan, Mode, View
from kvgen.plan.kernel import kernel_axes, kernel_text, make_kernel_plan
from kvgen.plan.parts import PartsPlan, PlaneCopy
from kvgen.spec.model import PART_LEVEL, Pack, Spec


@dataclass(frozen=True)
class PlaneKernelPlan:
    """The kernel of one plane: its views, its axes and its text."""

    index: int
    name: str
    slotless: bool
    leaf: View
    obj: View
    slot: tuple[str, ...]
    row: tuple[str, ...]
    outer: tuple[str, ...]
    extents: tuple[str, ...]
    params: tuple[str, ...]
    body: tuple[str, ...]
    #: Body of the module's `_views_<name>(tensor, leaf, g, w, num_tokens)`.
    views: tuple[str, ...]
    layerwise: bool

    @property
    def ident(self) -> str:
        """The plane's suffix in the module's function names: its index, since a plane's
        name comes from a spec and must never become code."""
        return str(self.index)

    @property
    def spec_fields(self) -> tuple[tuple[str, object], ...]:
        """The fields of this plane's `kernels.KernelSpec`."""
        return (("table", True), ("folded", self.slot == (SLOT,)), ("layerwise", self.layerwise),
                ("extents", self.extents), ("row", self.row), ("outer", self.outer), ("cache_axes", self.leaf.axes),
                ("object_axes", self.obj.axes), ("slotless", self.slotless), ("aligned", True))

    @property
    def summary(self) -> str:
        what = "no slots: one row per layer" if self.slotless else f"rows [{' '.join(self.row)}]"
        return f"{self.name}: {what}" + (f", outer {' x '.join(self.outer)}" if self.outer else "")


@dataclass(frozen=True)
class PartsKernelPlan:
    """The Triton kernels of one format-2 connector, one per plane, in plane order."""

    parts: PartsPlan
    planes: tuple[PlaneKernelPlan, ...]
    #: Body of the module's `_leaves(kvcaches, g, plane)`: every layer's leaf of one plane.
    leaves: str

    @property
    def module(self) -> str:
        return f"{self.parts.module}_triton"

    @property
    def sizes(self) -> tuple[str, ...]:
        """A regions object's region bytes per layer, over `g` and `num_tokens` (() for rows)."""
        return self.parts.sizes

    @property
    def layerwise(self) -> bool:
        return self.parts.mode is Mode.LAYERWISE

    @property
    def rows(self) -> bool:
        return self.parts.obj.pack is Pack.ROWS

    @property
    def sources(self) -> tuple[Spec, Spec]:
        return (self.parts.paged, self.parts.obj)

    @property
    def decorator(self) -> str:
        # A layer index of 1 must stay a run-time value: the kernel widens it to 64 bits.
        return '@triton.jit(do_not_specialize=("layer",))' if self.layerwise else "@triton.jit"

    @property
    def summary(self) -> tuple[str, str]:
        """For people: what a chunk costs, and how the kernels reach the cache."""
        per = "per layer and chunk" if self.layerwise else "per chunk"
        return (f"one launch per plane {per} ({len(self.planes)} planes), grid (whole blocks + token tiles, outer)",
                "leaves by a table over L; " + "; ".join(p.summary for p in self.planes))

    @property
    def grid(self) -> str:
        return "; ".join(self.summary)


def _leaf_source(paged: Spec, plane: int) -> str:
    """The plane's leaf expression inside the torch copy's layer loop."""
    return "kvcaches" + "".join(f"[{plane}]" if a == PART_LEVEL else f"[{LOOP_VARS[a]}]" for a in paged.lists)


def _rewrite(expr: str, i: int, swaps: dict[str, str]) -> str:
    """A torch-copy view expression of plane `i` in the kernel's terms: the word of the
    kernel's own call (`w`) for the plane's word of the torch call (`wd[i]`)."""
    swaps = {f"(g.planes[{i}].C // wd[{i}])": "w.C", f"wd[{i}]": "w.dtype.itemsize", **swaps}
    for old, new in swaps.items():
        expr = expr.replace(old, new)
    return expr


def _plane_kernel(parts: PartsPlan, pc: PlaneCopy, index: int) -> PlaneKernelPlan:
    copy, layerwise = pc.copy, parts.mode is Mode.LAYERWISE
    source = _leaf_source(parts.paged, pc.plane.index)
    if source not in copy.cache_view.expr:
        raise ValueError(f"{parts.module}: plane {pc.plane.name}'s cache view does not read {source}")
    leaf = View(_rewrite(copy.cache_view.expr, index, {source: "leaf"}), copy.cache_view.axes)
    obj = View(_rewrite(copy.object_view.expr, index, {"ck.num_tokens": "num_tokens"}), copy.object_view.axes)
    left = [name for name in ("wd[", "ck.", "kvcaches") if name in leaf.expr + obj.expr]
    if left:  # the torch copy's views name something the kernel's views do not have
        raise ValueError(f"{parts.module}: plane {pc.plane.name}'s views still use {', '.join(left)}")
    slot = () if pc.slotless else (SLOT,) if SLOT in leaf.axes else ("B", "N")
    row, outer, extents = kernel_axes(leaf, obj, ("L",), slot, layerwise)
    params, body = kernel_text(layerwise, leaf, obj, ("L",), slot, aligned=True)
    views = ["rows = runtime.bytes_of(tensor)"]
    if parts.sizes:
        views.append("at = runtime.region_starts(_region_sizes(g, num_tokens))  # each region in a layer")
    views += [f"# this plane of one cache leaf: [{' '.join(leaf.axes)}], and of the object: [{' '.join(obj.axes)}]",
              f"x = {leaf.expr}", f"o = {obj.expr}", "return x, o"]
    return PlaneKernelPlan(index, pc.plane.name, pc.slotless, leaf, obj, slot, row, outer, extents, params, body,
                           tuple(views), layerwise)


def make_parts_kernel_plan(parts: PartsPlan) -> PartsKernelPlan:
    planes = tuple(_plane_kernel(parts, pc, i) for i, pc in enumerate(parts.planes))
    leaf = "kvcaches" + "".join("[plane]" if a == PART_LEVEL else "[layer]" for a in parts.paged.lists)
    return PartsKernelPlan(parts, planes, f"[{leaf} for layer in range(g.L)]")


def kernel_grid(plan: object) -> str | None:
    """The launch grid of a connector's kernel, for people; None for anything that is not a
    connector's plan. (Here, not in kvgen.plan.kernel, which this module builds on.)"""
    if isinstance(plan, PartsPlan):
        return make_parts_kernel_plan(plan).grid
    return make_kernel_plan(plan).grid if isinstance(plan, CopyPlan) else None
