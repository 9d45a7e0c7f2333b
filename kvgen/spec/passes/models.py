"""Passes over model specs and `pack: groups` objects: what their schemas cannot say.

`check_model` looks at one model file (every cache-list entry named exactly once, state
tensor splits, names); `check_groups_object` at one groups object. `check_model_library`
checks what needs the other files: a group's layout exists and keeps one entry per layer,
its sizes fit that layout, an object's members are whole-chunk objects. Every problem is
located by YAML path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvgen.errors import KVLayoutError, Problem
from kvgen.names import Named, resolve
from kvgen.spec.loader import Document
from kvgen.spec.model import ITEMSIZE, Pack, Part, Spec
from kvgen.spec.models import OTHERS, ModelSpec


def check_model(model: ModelSpec, doc: Document) -> list[Problem]:
    """One model file: layer sets, state tensors, names."""
    out: list[Problem] = []
    clash = set(model.group_names) & set(model.state_names)
    for name in sorted(clash):
        out.append(doc.problem(("state", name), f"{name!r} names a group and a state group; names must differ "
                                                "(an object's carries names them)", key=True))
    out += _tensor_problems(model, doc)
    if clash:  # the layer sets of the two are one entry in the typed model: checking them would mislead
        return out
    sections = [("groups", g.name, g.layers) for g in model.groups] + [("state", s.name, s.layers)
                                                                       for s in model.states]
    others = [(sec, name) for sec, name, _ in sections if doc.data[sec][name]["layers"] == OTHERS]
    for sec, name in others[1:]:
        out.append(doc.problem((sec, name, "layers"), f"only one group may take the others; "
                                                             f"{others[0][1]!r} already does"))
    owner: dict[int, str] = {}
    for sec, name, layers in sections:
        path = (sec, name, "layers")
        past = [i for i in layers if i >= model.layers]
        if past:
            out.append(doc.problem(path, f"layer {past[0]} is past the model's {model.layers} cache entries "
                                         f"(0..{model.layers - 1})"))
        if not layers and (sec, name) not in others[1:]:  # a second `others` is reported as such
            out.append(doc.problem(path, "this layer set names no entry of the cache list"))
        for i in layers:
            if i in owner and i < model.layers:
                out.append(doc.problem(path, f"layer {i} is already in {owner[i]!r}; each entry of the cache "
                                             "list belongs to one group or state group"))
                break
        for i in layers:
            owner.setdefault(i, name)
    missing = [i for i in range(model.layers) if i not in owner]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        out.append(doc.problem(("layers",), f"{len(missing)} of {model.layers} cache entries belong to no group "
                                            f"or state group: {shown} (give them a group, or `layers: others`)"))
    return out


def _tensor_problems(model: ModelSpec, doc: Document) -> list[Problem]:
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


def _section_problems(t: Any, doc: Document, path: tuple[Any, ...]) -> list[Problem]:
    """A section list: over a split dim, and summing to its size."""
    if t.split is None:
        return [doc.problem(path, "sections divide the split dim; give the tensor a split")]
    if sum(t.sections) != t.shape[t.split]:
        return [doc.problem(path, f"the sections {list(t.sections)} sum to {sum(t.sections)}, not to the split "
                                  f"dim's {t.shape[t.split]} (shape {list(t.shape)}, split {t.split})")]
    return []


def check_groups_object(spec: Spec, doc: Document) -> list[Problem]:
    """A `pack: groups` object: bytes, shaped by its members; nothing of its own to lay out."""
    if spec.pack is not Pack.GROUPS:
        return []
    out = [doc.problem((key,), f"a groups object takes its layout from its members; leave {key} out", key=True)
           for key in ("lists", "dims", "sizes", "dtypes", "parts", "fields") if key in doc.data]
    if spec.kind != "object":
        out.append(doc.problem(("pack",), "pack: groups is for kind: object"))
    return out


def check_model_library(entries: Sequence[tuple[Any, Document]]) -> list[Problem]:
    """Models against the layouts they name; groups objects against their members."""
    specs = {s.name: s for s, _ in entries if isinstance(s, Spec)}
    named = [Named(s.name, s.aliases, tuple(f for f in (s.format, s.lmcache_format) if f)) for s in specs.values()]
    out: list[Problem] = []
    for spec, doc in entries:
        if isinstance(spec, ModelSpec):
            for g in spec.groups:
                out += _group_problems(spec, g.name, doc, specs, named)
        elif isinstance(spec, Spec) and spec.pack is Pack.GROUPS:
            for i, name in enumerate(spec.members):
                member = _lookup(name, specs, named)
                why = None
                if member is None:
                    why = f"unknown object {name!r}"
                elif member.is_paged or member.pack is Pack.GROUPS:
                    why = f"{member.name} is not a memory object of one cache"
                elif member.lists:
                    why = f"{member.name} is a per-layer object (lists: {list(member.lists)})"
                if why:
                    out.append(doc.problem(("members", i), f"{why}; members are whole-chunk objects "
                                                           "such as kv_2ltd, kv_mla, kv_planes"))
    return out


def _lookup(name: str, specs: dict[str, Spec], named: list[Named]) -> Spec | None:
    try:
        return specs[resolve(name, named)]
    except KVLayoutError:  # an unknown or ambiguous name: the caller says so
        return None


def _group_problems(model: ModelSpec, name: str, doc: Document, specs: dict[str, Spec],
                    named: list[Named]) -> list[Problem]:
    group = next(g for g in model.groups if g.name == name)
    path = ("groups", name)
    layout = _lookup(group.layout, specs, named)
    if layout is None:
        return [doc.problem((*path, "layout"), f"unknown layout {group.layout!r}; a group names a paged layout "
                                               "of the library (kvgen list)")]
    if not layout.is_paged:
        return [doc.problem((*path, "layout"), f"{layout.name} is a memory object; a group names a paged layout")]
    if layout.lists[:1] != ("L",):
        return [doc.problem((*path, "layout"), f"{layout.name} keeps its layers {_where_layers(layout)}; a group's "
                                               "layout holds one cache-list entry per layer (lists start with L)")]
    out = []
    parts = {p.name for p in layout.parts if p.name}
    for key, value in group.sizes:
        axis, _, part = key.partition(".")
        at = (*path, "sizes", key)
        if part and part not in parts:
            out.append(doc.problem(at, f"{layout.name} has no part {part!r}" +
                                       (f" (parts: {', '.join(sorted(parts))})" if parts else ""), key=True))
            continue
        if axis == "C" and not part and layout.is_multipart:
            wide = [p.name for p in layout.parts if p.has("C")]
            out.append(doc.problem(at, f"{layout.name} has parts of their own widths: write "
                                       f"{', '.join(f'C.{p}' for p in wide)} instead of C", key=True))
            continue
        owner = next((p for p in layout.parts if p.name == part), layout.parts[0])
        has = owner.has(axis) or axis in layout.lists
        if axis in ("H", "N") and not has and not layout.has(axis):
            out.append(doc.problem(at, f"{layout.name} has no {axis} axis", key=True))
            continue
        if axis == "C" and not owner.has("C"):
            where = f"part {part!r} of {layout.name}" if part else layout.name
            out.append(doc.problem(at, f"{where} has no C axis (its dims: {owner.render()})", key=True))
            continue
        fixed = _fixed_c(owner) if axis == "C" else layout.size(axis)
        if fixed is not None and fixed != value:
            out.append(doc.problem(at, f"{layout.name} fixes {key} = {fixed}"
                                       f"{' (its fields)' if owner.fields else ''}; this group says {value}"))
    if group.tokens_per_slot != 1 and layout.token_ratio != (1, 1):
        out.append(doc.problem((*path, "tokens_per_slot"), f"{layout.name} declares its own token-to-slot ratio; "
                                                           "give the ratio in the layout or in the group, not both"))
    for i, dtype in enumerate(group.dtypes):
        if dtype not in layout.dtypes:
            out.append(doc.problem((*path, "dtypes", i), f"{layout.name} cannot hold {dtype}; it holds "
                                                         f"{', '.join(layout.dtypes)}"))
    return out


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


__all__ = ["check_groups_object", "check_model", "check_model_library"]
