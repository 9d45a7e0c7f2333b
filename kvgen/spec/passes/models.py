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

from kvgen.errors import KVLayoutError, Problem, YamlPath
from kvgen.names import Named, resolve
from kvgen.spec.loader import Document
from kvgen.spec.model import ITEMSIZE, Pack, Part, Spec
from kvgen.spec.models import OTHERS, ModelSpec


def check_model(model: ModelSpec, doc: Document) -> list[Problem]:
    """One model file: layer sets, state tensors, names."""
    clash = set(model.group_names) & set(model.state_names)
    out = [doc.problem(("state", name), f"{name!r} names a group and a state group; names must differ "
                                        "(an object's carries names them)", key=True) for name in sorted(clash)]
    out += _tensor_problems(model, doc)
    if clash:  # the layer sets of the two are one entry in the typed model: checking them would mislead
        return out
    return out + _layer_set_problems(model, doc)


def _layer_set_problems(model: ModelSpec, doc: Document) -> list[Problem]:
    """Every entry of the cache list in exactly one group or state group; one `others` at most."""
    sections = [("groups", g.name, g.layers) for g in model.groups] + [("state", s.name, s.layers)
                                                                       for s in model.states]
    others = [(sec, name) for sec, name, _ in sections if doc.data[sec][name]["layers"] == OTHERS]
    out = [doc.problem((sec, name, "layers"), f"only one group may take the others; {others[0][1]!r} already does")
           for sec, name in others[1:]]
    owner: dict[int, str] = {}
    for sec, name, layers in sections:
        out += _one_layer_set(model, doc, (sec, name, "layers"), layers, owner,
                              second_others=(sec, name) in others[1:])
    missing = [i for i in range(model.layers) if i not in owner]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        out.append(doc.problem(("layers",), f"{len(missing)} of {model.layers} cache entries belong to no group "
                                            f"or state group: {shown} (give them a group, or `layers: others`)"))
    return out


def _one_layer_set(model: ModelSpec, doc: Document, path: YamlPath, layers: Sequence[int], owner: dict[int, str],
                   *, second_others: bool) -> list[Problem]:
    """One group's layers: within the model, not empty, none already another's; `owner` gains them."""
    out = []
    past = [i for i in layers if i >= model.layers]
    if past:
        out.append(doc.problem(path, f"layer {past[0]} is past the model's {model.layers} cache entries "
                                     f"(0..{model.layers - 1})"))
    if not layers and not second_others:  # a second `others` is reported as such
        out.append(doc.problem(path, "this layer set names no entry of the cache list"))
    taken = next((i for i in layers if i in owner and i < model.layers), None)
    if taken is not None:
        out.append(doc.problem(path, f"layer {taken} is already in {owner[taken]!r}; each entry of the cache "
                                     "list belongs to one group or state group"))
    for i in layers:
        owner.setdefault(i, str(path[1]))
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
    return out


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
    lib = _Layouts({s.name: s for s, _ in entries if isinstance(s, Spec)})
    out: list[Problem] = []
    for spec, doc in entries:
        if isinstance(spec, ModelSpec):
            for g in spec.groups:
                out += _group_problems(spec, g.name, doc, lib)
        elif isinstance(spec, Spec) and spec.pack is Pack.GROUPS:
            out += [doc.problem(("members", i), f"{why}; members are whole-chunk objects such as kv_2ltd, kv_mla, "
                                                "kv_planes")
                    for i, name in enumerate(spec.members) if (why := _member_problem(name, lib))]
    return out


class _Layouts:
    """The library's specs by name, found as kvgen finds them (aliases and formats too)."""

    def __init__(self, specs: dict[str, Spec]):
        self.specs = specs
        self.named = [Named(s.name, s.aliases, tuple(f for f in (s.format, s.lmcache_format) if f))
                      for s in specs.values()]

    def lookup(self, name: str) -> Spec | None:
        try:
            return self.specs[resolve(name, self.named)]
        except KVLayoutError:  # an unknown or ambiguous name: the caller says so
            return None


def _member_problem(name: str, lib: _Layouts) -> str | None:
    """Why a groups object's member is not a whole-chunk object of one cache, or None."""
    member = lib.lookup(name)
    if member is None:
        return f"unknown object {name!r}"
    if member.is_paged or member.pack is Pack.GROUPS:
        return f"{member.name} is not a memory object of one cache"
    if member.lists:
        return f"{member.name} is a per-layer object (lists: {list(member.lists)})"
    return None


def _group_problems(model: ModelSpec, name: str, doc: Document, lib: _Layouts) -> list[Problem]:
    group = next(g for g in model.groups if g.name == name)
    path = ("groups", name)
    layout = lib.lookup(group.layout)
    if layout is None:
        return [doc.problem((*path, "layout"), f"unknown layout {group.layout!r}; a group names a paged layout "
                                               "of the library (kvgen list)")]
    if not layout.is_paged:
        return [doc.problem((*path, "layout"), f"{layout.name} is a memory object; a group names a paged layout")]
    if layout.lists[:1] != ("L",):
        return [doc.problem((*path, "layout"), f"{layout.name} keeps its layers {_where_layers(layout)}; a group's "
                                               "layout holds one cache-list entry per layer (lists start with L)")]
    out = [p for key, value in group.sizes if (p := _size_problem(layout, doc, (*path, "sizes", key), value))]
    out += [doc.problem((*path, "dtypes", i), f"{layout.name} cannot hold {dtype}; it holds "
                                              f"{', '.join(layout.dtypes)}")
            for i, dtype in enumerate(group.dtypes) if dtype not in layout.dtypes]
    return out


def _size_problem(layout: Spec, doc: Document, at: YamlPath, value: int) -> Problem | None:
    """A group's size (`H`, `C`, `N` or `C.PART`, written at `at`) against its layout, or None when it fits."""
    key = str(at[-1])
    axis, _, part = key.partition(".")
    named = _part_named(layout, axis, part)
    if named is not None:
        return doc.problem(at, named, key=True)
    owner = next((p for p in layout.parts if p.name == part), layout.parts[0])
    has = owner.has(axis) or axis in layout.lists
    if axis in ("H", "N") and not has and not layout.has(axis):
        return doc.problem(at, f"{layout.name} has no {axis} axis", key=True)
    if axis == "C" and not owner.has("C"):
        where = f"part {part!r} of {layout.name}" if part else layout.name
        return doc.problem(at, f"{where} has no C axis (its dims: {owner.render()})", key=True)
    fixed = _fixed_c(owner) if axis == "C" else layout.size(axis)
    if fixed is not None and fixed != value:
        return doc.problem(at, f"{layout.name} fixes {key} = {fixed}"
                               f"{' (its fields)' if owner.fields else ''}; this group says {value}")
    return None


def _part_named(layout: Spec, axis: str, part: str) -> str | None:
    """What is wrong with the part a size names (`C.PART`), or with a plain C of a layout of parts."""
    parts = {p.name for p in layout.parts if p.name}
    if part and part not in parts:
        return f"{layout.name} has no part {part!r}" + (f" (parts: {', '.join(sorted(parts))})" if parts else "")
    if axis == "C" and not part and layout.is_multipart:
        wide = [p.name for p in layout.parts if p.has("C")]
        return f"{layout.name} has parts of their own widths: write {', '.join(f'C.{p}' for p in wide)} instead of C"
    return None


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
