"""Passes over model specs and `pack: groups` objects: what their schemas cannot say.

A model file is checked by the passes of `MODEL_PASSES` in order (names, state tensors, layer
sets); `check_groups_object` looks at one groups object. `check_model_library` checks what
needs the other files: each group of a model by the passes of `GROUP_PASSES` against the
layout it names (a paged layout of the library that keeps one entry per layer, sizes that fit
it, dtypes it holds), and a groups object's members (whole-chunk objects). Every problem is
located by YAML path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvgen.errors import KVLayoutError, Problem, YamlPath
from kvgen.names import Named, resolve
from kvgen.spec.loader import Document
from kvgen.spec.model import ITEMSIZE, Pack, Part, Spec
from kvgen.spec.models import OTHERS, Group, ModelSpec, StateTensor

#: A pass over one model file: the model and its document in, the problems it finds out.
ModelPass = Callable[[ModelSpec, Document], list[Problem]]


# -- one model file ------------------------------------------------------------------------------

def check_name_clash(model: ModelSpec, doc: Document) -> list[Problem]:
    """A group and a state group may not share a name (an object's carries name them)."""
    return [doc.problem(("state", name), f"{name!r} names a group and a state group; names must differ "
                                         "(an object's carries names them)", key=True)
            for name in sorted(_clash(model))]


def check_state_tensors(model: ModelSpec, doc: Document) -> list[Problem]:
    """Each state group's tensors: names once each, a split that is a dim, sections that fill it."""
    out: list[Problem] = []
    for s in model.states:
        seen: set[str] = set()
        for j, t in enumerate(s.tensors):
            path = ("state", s.name, "tensors", j)
            if t.name in seen:
                out.append(doc.problem((*path, "name"), f"state tensor {t.name!r} appears twice in {s.name!r}"))
            seen.add(t.name)
            if t.split is not None and t.split >= len(t.shape):
                out.append(doc.problem((*path, "split"), f"split {t.split} is not a dim of shape "
                                                         f"{list(t.shape)} (dims 0..{len(t.shape) - 1})"))
            elif t.sections is not None:
                out += _section_problems(t, doc, (*path, "sections"))
    return out


def check_layer_sets(model: ModelSpec, doc: Document) -> list[Problem]:
    """Every entry of the cache list in exactly one group or state group; one group takes the others."""
    if _clash(model):  # the layer sets of the two are one entry in the typed model: checking them would mislead
        return []
    sections = [("groups", g.name, g.layers) for g in model.groups] + [("state", s.name, s.layers)
                                                                       for s in model.states]
    others = [(sec, name) for sec, name, _ in sections if doc.data[sec][name]["layers"] == OTHERS]
    out = [doc.problem((sec, name, "layers"), f"only one group may take the others; {others[0][1]!r} already does")
           for sec, name in others[1:]]
    owner: dict[int, str] = {}
    for sec, name, layers in sections:
        # A second `others` is reported as such, not as an empty layer set.
        out += _layer_set_problems(model, doc, (sec, name, "layers"), layers, owner, (sec, name) in others[1:])
        for i in layers:
            owner.setdefault(i, name)
    return out + _uncovered(model, doc, owner)


MODEL_PASSES: tuple[ModelPass, ...] = (check_name_clash, check_state_tensors, check_layer_sets)


def check_model(model: ModelSpec, doc: Document) -> list[Problem]:
    """One model file: names, state tensors, layer sets."""
    return [p for check in MODEL_PASSES for p in check(model, doc)]


def _clash(model: ModelSpec) -> set[str]:
    return set(model.group_names) & set(model.state_names)


def _section_problems(t: StateTensor, doc: Document, path: YamlPath) -> list[Problem]:
    """A section list: over a split dim, and summing to its size."""
    if t.split is None:
        return [doc.problem(path, "sections divide the split dim; give the tensor a split")]
    if sum(t.sections or ()) != t.shape[t.split]:
        return [doc.problem(path, f"the sections {list(t.sections or ())} sum to {sum(t.sections or ())}, not to "
                                  f"the split dim's {t.shape[t.split]} (shape {list(t.shape)}, split {t.split})")]
    return []


def _layer_set_problems(model: ModelSpec, doc: Document, path: YamlPath, layers: tuple[int, ...],
                        owner: dict[int, str], second_others: bool) -> list[Problem]:
    """One layer set: inside the cache list, not empty, no entry an earlier set already owns."""
    out = []
    past = [i for i in layers if i >= model.layers]
    if past:
        out.append(doc.problem(path, f"layer {past[0]} is past the model's {model.layers} cache entries "
                                     f"(0..{model.layers - 1})"))
    if not layers and not second_others:
        out.append(doc.problem(path, "this layer set names no entry of the cache list"))
    taken = next((i for i in layers if i in owner and i < model.layers), None)
    if taken is not None:
        out.append(doc.problem(path, f"layer {taken} is already in {owner[taken]!r}; each entry of the cache "
                                     "list belongs to one group or state group"))
    return out


def _uncovered(model: ModelSpec, doc: Document, owner: dict[int, str]) -> list[Problem]:
    missing = [i for i in range(model.layers) if i not in owner]
    if not missing:
        return []
    shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
    return [doc.problem(("layers",), f"{len(missing)} of {model.layers} cache entries belong to no group "
                                     f"or state group: {shown} (give them a group, or `layers: others`)")]


def check_groups_object(spec: Spec, doc: Document) -> list[Problem]:
    """A `pack: groups` object: bytes, shaped by its members; nothing of its own to lay out."""
    if spec.pack is not Pack.GROUPS:
        return []
    out = [doc.problem((key,), f"a groups object takes its layout from its members; leave {key} out", key=True)
           for key in ("lists", "dims", "sizes", "dtypes", "parts", "fields") if key in doc.data]
    if spec.kind != "object":
        out.append(doc.problem(("pack",), "pack: groups is for kind: object"))
    return out


# -- against the library -------------------------------------------------------------------------

@dataclass(frozen=True)
class Layouts:
    """The library's layouts and objects, found by name, alias or format as `kvgen list` shows them."""

    specs: dict[str, Spec]
    named: tuple[Named, ...]

    @classmethod
    def of(cls, entries: Sequence[tuple[Any, Document]]) -> Layouts:
        specs = {s.name: s for s, _ in entries if isinstance(s, Spec)}
        return cls(specs, tuple(Named(s.name, s.aliases, tuple(f for f in (s.format, s.lmcache_format) if f))
                                for s in specs.values()))

    def find(self, name: str) -> Spec | None:
        try:
            return self.specs[resolve(name, list(self.named))]
        except KVLayoutError:  # an unknown or ambiguous name: the caller says so
            return None


@dataclass(frozen=True)
class GroupSite:
    """One group of a model with the paged layout it names and where the group is written."""

    group: Group
    layout: Spec
    doc: Document

    @property
    def path(self) -> YamlPath:
        return ("groups", self.group.name)


#: A pass over one group of a model, against the layout it names.
GroupPass = Callable[[GroupSite], list[Problem]]


def check_group_sizes(site: GroupSite) -> list[Problem]:
    """Each size names a part and an axis the layout has, and agrees with what the layout fixes."""
    return [p for key, value in site.group.sizes if (p := _size_problem(site, key, value)) is not None]


def check_group_ratio(site: GroupSite) -> list[Problem]:
    """A token-to-slot ratio is given once: in the layout or in the group."""
    if site.group.tokens_per_slot != 1 and site.layout.token_ratio != (1, 1):
        return [site.doc.problem((*site.path, "tokens_per_slot"), f"{site.layout.name} declares its own "
                                 "token-to-slot ratio; give the ratio in the layout or in the group, not both")]
    return []


def check_group_dtypes(site: GroupSite) -> list[Problem]:
    """Every dtype of the group is one the layout holds."""
    return [site.doc.problem((*site.path, "dtypes", i), f"{site.layout.name} cannot hold {dtype}; it holds "
                                                        f"{', '.join(site.layout.dtypes)}")
            for i, dtype in enumerate(site.group.dtypes) if dtype not in site.layout.dtypes]


GROUP_PASSES: tuple[GroupPass, ...] = (check_group_sizes, check_group_ratio, check_group_dtypes)


def check_model_library(entries: Sequence[tuple[Any, Document]]) -> list[Problem]:
    """Models against the layouts they name; groups objects against their members, file by file."""
    layouts = Layouts.of(entries)
    out: list[Problem] = []
    for spec, doc in entries:
        if isinstance(spec, ModelSpec):
            out += [p for g in spec.groups for p in _group_problems(g, doc, layouts)]
        elif isinstance(spec, Spec) and spec.pack is Pack.GROUPS:
            out += _member_problems(spec, doc, layouts)
    return out


def _group_problems(group: Group, doc: Document, layouts: Layouts) -> list[Problem]:
    """The layout a group names, then the group against it by each of GROUP_PASSES."""
    layout = _paged_layout(group, layouts)
    if isinstance(layout, str):
        return [doc.problem(("groups", group.name, "layout"), layout)]
    site = GroupSite(group, layout, doc)
    return [p for check in GROUP_PASSES for p in check(site)]


def _paged_layout(group: Group, layouts: Layouts) -> Spec | str:
    """The layout a group names, or why it cannot hold the group."""
    layout = layouts.find(group.layout)
    if layout is None:
        return f"unknown layout {group.layout!r}; a group names a paged layout of the library (kvgen list)"
    if not layout.is_paged:
        return f"{layout.name} is a memory object; a group names a paged layout"
    if layout.lists[:1] != ("L",):
        return (f"{layout.name} keeps its layers {_where_layers(layout)}; a group's layout holds one "
                "cache-list entry per layer (lists start with L)")
    return layout


def _size_problem(site: GroupSite, key: str, value: int) -> Problem | None:
    """What is wrong with one of a group's sizes (`AXIS: n` or `C.PART: n`), or None."""
    at = (*site.path, "sizes", key)
    why = _size_axis_problem(site.layout, key)
    if why:
        return site.doc.problem(at, why, key=True)
    axis, _, part = key.partition(".")
    owner = _owner(site.layout, part)
    fixed = _fixed_c(owner) if axis == "C" else site.layout.size(axis)
    if fixed is not None and fixed != value:
        return site.doc.problem(at, f"{site.layout.name} fixes {key} = {fixed}"
                                    f"{' (its fields)' if owner.fields else ''}; this group says {value}")
    return None


def _size_axis_problem(layout: Spec, key: str) -> str | None:
    """Why a group's size key (`AXIS` or `C.PART`) names nothing `layout` has, or None."""
    axis, _, part = key.partition(".")
    why = _size_part_problem(layout, axis, part)
    if why:
        return why
    owner = _owner(layout, part)
    if axis in ("H", "N") and not (owner.has(axis) or axis in layout.lists) and not layout.has(axis):
        return f"{layout.name} has no {axis} axis"
    if axis == "C" and not owner.has("C"):
        where = f"part {part!r} of {layout.name}" if part else layout.name
        return f"{where} has no C axis (its dims: {owner.render()})"
    return None


def _size_part_problem(layout: Spec, axis: str, part: str) -> str | None:
    """Why a size key names a part `layout` lacks, or a plain C where each part has its own, or None."""
    parts = {p.name for p in layout.parts if p.name}
    if part and part not in parts:
        return f"{layout.name} has no part {part!r}" + (f" (parts: {', '.join(sorted(parts))})" if parts else "")
    if axis == "C" and not part and layout.is_multipart:
        wide = [p.name for p in layout.parts if p.has("C")]
        return f"{layout.name} has parts of their own widths: write {', '.join(f'C.{p}' for p in wide)} instead of C"
    return None


def _owner(layout: Spec, part: str) -> Part:
    """The part a size key names (`C.PART`), or the layout's first part for a plain axis."""
    return next((p for p in layout.parts if p.name == part), layout.parts[0])


def _fixed_c(part: Part) -> int | None:
    """C that a part fixes: its own size, or the row its fields fill (in its dtype's units)."""
    if part.size("C") is not None:
        return part.size("C")
    if part.fields and part.dtypes and part.row_bytes:
        return part.row_bytes // ITEMSIZE[part.dtypes[0]]
    return None


def _where_layers(layout: Spec) -> str:
    if "L" in layout.lists:
        return f"at list level {layout.lists.index('L')} (lists: {list(layout.lists)})"
    return "inside its tensors" if layout.has("L") else "nowhere"


def _member_problems(spec: Spec, doc: Document, layouts: Layouts) -> list[Problem]:
    """A groups object's members: each a whole-chunk memory object of one cache."""
    out = []
    for i, name in enumerate(spec.members):
        why = _member_problem(name, layouts.find(name))
        if why:
            out.append(doc.problem(("members", i), f"{why}; members are whole-chunk objects "
                                                   "such as kv_2ltd, kv_mla, kv_planes"))
    return out


def _member_problem(name: str, member: Spec | None) -> str | None:
    if member is None:
        return f"unknown object {name!r}"
    if member.is_paged or member.pack is Pack.GROUPS:
        return f"{member.name} is not a memory object of one cache"
    if member.lists:
        return f"{member.name} is a per-layer object (lists: {list(member.lists)})"
    return None


__all__ = ["GROUP_PASSES", "MODEL_PASSES", "check_groups_object", "check_model", "check_model_library"]
