"""One typed plan for a whole build: everything the emitter renders, decided here.

`plan_package(library)` is the only planning call a build makes; rendering receives the
`PackagePlan` and nothing else, and the templates place its ready strings and values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import product
from typing import Any

from kvgen.plan.code import Method, copy_methods, planes_methods, planes_shape_body, shape_body
from kvgen.plan.convert import Converter, plan_converters
from kvgen.plan.copy import CopyPlan, Mode, plan_library
from kvgen.plan.geometry import geometry_body, planes_geometry_body
from kvgen.plan.kernel import KernelPlan, PlanesKernelPlan, make_kernel_plan, make_planes_kernel_plan
from kvgen.plan.layouts import Fields, layout_fields
from kvgen.plan.models import ModelPlan, plan_models
from kvgen.plan.planes import PlanesPlan, compatible_planes, plan_planes
from kvgen.plan.program import ProgramPlan, planes_views, program_plan
from kvgen.plan.transfer import TransferPlan, plan_transfers
from kvgen.spec.library import UNDEFINED, Library
from kvgen.spec.model import ITEMSIZE, Spec
from kvgen.spec.transfers import TransferPair


def layout_facts(spec: Spec) -> Fields:
    """The entry of `LAYOUTS` in the generated `__init__`."""
    facts: list[tuple[str, Any]] = [("kind", spec.kind), ("lists", spec.lists),
                                    ("dims", tuple(d.axes for d in spec.dims)), ("arrow", spec.arrow()),
                                    ("aliases", spec.aliases)]
    if spec.is_paged:
        facts += [("lmcache", spec.lmcache_format), ("engines", spec.engines), ("placement", spec.placement)]
        if spec.versions:
            facts.append(("versions", spec.versions))
        if spec.given:
            facts.append(("given", tuple(d.axes for d in spec.given)))
        if spec.token_ratio[1] > 1:  # format 3: detection keeps the cache for the engine that says so
            facts.append(("slots_per_token", spec.token_ratio[1]))
        if spec.quant:  # format 3: detection reads the engine's word for it, and the row the fields fill
            part = spec.parts[0]
            facts += [("quant", spec.quant), ("row", (part.row_bytes or 0) // ITEMSIZE[part.dtypes[0]])]
    else:
        facts += [("format", spec.format)]
    facts.append(("planes", spec.planes))
    if spec.is_paged and not spec.is_simple:
        # Format 2: what each moved plane is (its part, field, value dtype and count).
        facts.append(("parts", tuple(p.name for p in spec.parts)))
        facts.append(("moved", tuple((pl.name, pl.dtype, pl.field.count if pl.field else None)
                                     for pl in spec.moved_planes())))
    if spec.pack is not None:
        facts.append(("pack", str(spec.pack)))
    return tuple(facts)


@dataclass(frozen=True)
class ConnectorPlan:
    """One generated connector module."""

    copy: CopyPlan | PlanesPlan
    base_class: str
    paged_fields: Fields
    object_fields: Fields
    #: Body of the module's `read_geometry(kvcaches)`.
    geometry: tuple[str, ...]
    shape: str
    methods: tuple[Method, ...]
    #: The copy description movers execute (kvgen.plan.program), rendered as PROGRAM.
    program: ProgramPlan
    #: Fields of the PAGED constant written one item per line (a format-2 cache's parts).
    wide_fields: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        return self.copy.module

    @property
    def sources(self) -> tuple[Spec, Spec]:
        return (self.copy.paged, self.copy.obj)


@dataclass(frozen=True)
class PackagePlan:
    """Everything one build writes: connectors, format tables, converters, the index."""

    library: Library
    connectors: tuple[ConnectorPlan, ...]
    formats: tuple[tuple[str, int], ...]
    #: (current label, label after a store) pairs a store may make.
    transitions: tuple[tuple[str, str], ...]
    converters: tuple[Converter, ...]
    layouts: tuple[tuple[str, Fields], ...]
    #: The Triton kernel module of each connector, in the connectors' order.
    kernels: tuple[KernelPlan | PlanesKernelPlan, ...] = ()
    #: Layout-to-layout transfer modules (kvgen.plan.transfer), from the transfers files.
    transfers: tuple[TransferPlan, ...] = ()
    #: Model connectors, one per (model, groups object) pair (kvgen.plan.models).
    models: tuple[ModelPlan, ...] = ()

    @property
    def aliases(self) -> tuple[tuple[str, str], ...]:
        return tuple((alias, spec.name) for spec in self.library.specs for alias in spec.aliases)


def _layouts_connector(plan: CopyPlan) -> ConnectorPlan:
    return ConnectorPlan(plan, _base_class(plan), layout_fields(plan.paged), layout_fields(plan.obj),
                         geometry_body(plan.paged), shape_body(plan), copy_methods(plan), program_plan(plan))


def _planes_connector(plan: PlanesPlan) -> ConnectorPlan:
    program = program_plan(plan)
    objects, plane_leaves = planes_views(plan)
    views = (Method("_plane_objects", ("tensor: torch.Tensor", "g: runtime.Geometry", "ck: runtime.Chunk"),
                    objects, "tuple[torch.Tensor, ...]"),
             Method("_plane_leaves", ("kvcaches: Any", "g: runtime.Geometry"), plane_leaves,
                    "tuple[tuple[torch.Tensor, ...], ...]")) if program.planes else ()
    return ConnectorPlan(plan, _base_class(plan), layout_fields(plan.paged), layout_fields(plan.obj),
                         planes_geometry_body(plan.paged), planes_shape_body(plan),
                         planes_methods(plan, bool(program.planes)) + views,
                         program, ("parts",))


def _base_class(plan: CopyPlan | PlanesPlan) -> str:
    return "LayerwiseConnector" if plan.mode is Mode.LAYERWISE else "ChunkConnector"


def _planes_pairs(library: Library) -> list[PlanesPlan]:
    """The pairs of caches of several parts or fields with packed objects (spec format 2)."""
    return [plan_planes(p, o) for p, o in product(library.paged, library.objects) if compatible_planes(p, o)]


@dataclass(frozen=True)
class PairKind:
    """One kind of (layout, object) connector: how a build finds its pairs, and how it plans each
    pair's module and Triton twin. A new kind is one entry of PAIR_KINDS."""

    name: str
    plan_type: type
    pairs: Callable[[Library], Sequence[Any]]
    connector: Callable[[Any], ConnectorPlan]
    kernel: Callable[[Any], KernelPlan | PlanesKernelPlan]


#: The kinds of connector, in the order a build lists their modules.
PAIR_KINDS: tuple[PairKind, ...] = (
    # one tensor tree per side (spec format 1): kvgen.plan.copy
    PairKind("layouts", CopyPlan, plan_library, _layouts_connector, make_kernel_plan),
    # caches of several planes (parts, fields) and packed objects: kvgen.plan.planes
    PairKind("planes", PlanesPlan, _planes_pairs, _planes_connector, make_planes_kernel_plan),
)


def kind_of(plan: CopyPlan | PlanesPlan) -> PairKind:
    return next(k for k in PAIR_KINDS if type(plan) is k.plan_type)


def connector_plan(plan: CopyPlan | PlanesPlan) -> ConnectorPlan:
    return kind_of(plan).connector(plan)


def plan_connectors(library: Library) -> list[CopyPlan | PlanesPlan]:
    """Every connector of a build, kind by kind (PAIR_KINDS)."""
    return [plan for kind in PAIR_KINDS for plan in kind.pairs(library)]


def format_transitions(library: Library) -> tuple[tuple[str, str], ...]:
    """Each object's `accepts` and its own format, as (current, after store) pairs."""
    pairs = {(src, obj.format) for obj in library.objects if obj.format
             for src in (obj.format, *obj.accepts)}
    return tuple(sorted(pairs))


def skipped_models(library: Library) -> list[tuple[str, str, str]]:
    """(model, object, why) for each model/object pair a build does not generate (`kvgen explain`)."""
    return plan_models(library, plan_connectors(library))[1]


def plan_package(library: Library, transfers: Sequence[TransferPair] = ()) -> PackagePlan:
    plans = plan_connectors(library)
    return PackagePlan(
        library=library,
        connectors=tuple(connector_plan(p) for p in plans),
        formats=tuple(library.formats()),
        transitions=format_transitions(library),
        converters=tuple(plan_converters(library)),
        layouts=tuple((s.name, layout_facts(s)) for s in library.specs),
        kernels=tuple(kind_of(p).kernel(p) for p in plans),
        transfers=plan_transfers(tuple(transfers)),
        models=tuple(plan_models(library, plans)[0]),
    )


__all__ = ["PAIR_KINDS", "UNDEFINED", "ConnectorPlan", "PackagePlan", "PairKind", "connector_plan", "kind_of",
           "plan_connectors", "plan_package", "skipped_models"]
