"""Passes over the parts of a cache (format 2): where the parts are, each part as a tensor tree,
and what ties them together.

A cache of several parts is checked part by part with the passes of one tree
(kvgen.spec.passes.layout), its problems located at `parts.NAME.dims[...]`; then the rules
that tie the parts together. A part's fields are kvgen.spec.passes.fields'; an object's pack
is kvgen.spec.passes.objects'.
"""

from __future__ import annotations

import dataclasses

from kvgen.errors import Problem, YamlPath
from kvgen.spec.document import Document
from kvgen.spec.elements import tiled
from kvgen.spec.model import PART_LEVEL, Part, Spec
from kvgen.spec.passes.common import Pass, part_path
from kvgen.spec.passes.layout import check_axes_once, check_extents, check_fused

#: Fields only format 2 knows, at the top of a spec.
V2_FIELDS = ("parts", "fields", "pack", "members", "carries")


class _PartDocument:
    """A document seen through one part: format-1 passes written for `dims`, `lists` and
    `sizes` report at the part's own place (`parts.k.dims[1]`)."""

    def __init__(self, doc: Document, spec: Spec, part: Part):
        self.doc, self.part = doc, part
        # lists of the part's view leave P out: map their indices back to the spec's.
        self.lists = [i for i, a in enumerate(spec.lists) if a != PART_LEVEL]

    def problem(self, path: YamlPath, message: str, *, key: bool = False) -> Problem:
        head = path[0] if path else None
        if head == "dims":
            path = ("parts", self.part.name, *path)
        elif head == "lists" and len(path) > 1 and isinstance(path[1], int):
            path = ("lists", self.lists[path[1]], *path[2:])
        elif head == "sizes" and len(path) > 1 and self.part.size(str(path[1])) is not None:
            path = ("parts", self.part.name, *path)
        return self.doc.problem(path, message, key=key)


def part_view(spec: Spec, part: Part) -> Spec:
    """One part as a format-1 spec: the list levels without P, the part's dims, the shared
    sizes and the part's own, its dtypes."""
    return dataclasses.replace(spec, lists=spec.part_lists, dims=part.dims, sizes=(*spec.sizes, *part.sizes),
                               dtypes=part.dtypes, parts=(dataclasses.replace(part, name=""),))


def check_version_features(spec: Spec, doc: Document) -> list[Problem]:
    """Format-2 fields in a format-1 spec."""
    if spec.version >= 2:
        return []
    out = [doc.problem((key,), f"field {key!r} needs kvgen: 2 (this spec says kvgen: {spec.version})", key=True)
           for key in V2_FIELDS if key in doc.data]
    if PART_LEVEL in spec.lists:
        out.append(doc.problem(("lists", spec.lists.index(PART_LEVEL)),
                               "P (the list level of parts) needs kvgen: 2 and parts"))
    return out


def check_part_level(spec: Spec, doc: Document) -> list[Problem]:
    """Where the parts are, and what a spec with parts may not also say at its top."""
    if spec.version < 2 or not spec.is_paged:
        return []
    data, out = doc.data, []
    levels = [i for i, a in enumerate(spec.lists) if a == PART_LEVEL]
    if "parts" in data:
        for key, why in (("dims", "each part gives its own dims"), ("fields", "fields belong to a part"),
                         ("dtypes", "each part gives its own dtypes")):
            if key in data:
                out.append(doc.problem((key,), f"a spec with parts may not have a top-level {key!r}: {why}",
                                       key=True))
        if not levels:
            out.append(doc.problem(("lists",) if "lists" in data else ("parts",),
                                   "a cache of several parts needs the list level P, whose entries are the parts "
                                   "in order (e.g. lists: [L, P])"))
    elif levels:
        out.append(doc.problem(("lists", levels[0]), "P is the list level of parts: add parts, or remove P"))
    out += [doc.problem(("lists", i), "P may appear once in lists") for i in levels[1:]]
    return out


def check_kind_fields(spec: Spec, doc: Document) -> list[Problem]:
    """Parts and fields describe caches; pack describes objects."""
    if spec.version < 2:
        return []
    if spec.is_paged:
        return [doc.problem(("pack",), "pack is for objects (kind: object): it lays out a cache's planes in "
                                       "one memory object", key=True)] if "pack" in doc.data else []
    return [doc.problem((key,), f"{key!r} describes a paged cache; an object holds a cache's parts and fields "
                                "through pack (rows or regions)", key=True)
            for key in ("parts", "fields") if key in doc.data]


def check_parts(spec: Spec, doc: Document) -> list[Problem]:
    """Each part as a tensor tree (format-1 passes), then the rules tying the parts together."""
    if not spec.is_multipart or not spec.is_paged:
        return []
    out = [p for part in spec.parts for p in _part_problems(spec, part, doc)]
    return out + _slot_form_problems(spec, doc) + _shared_size_problems(spec, doc)


def _part_problems(spec: Spec, part: Part, doc: Document) -> list[Problem]:
    """One part: the tree rules at its own place, then what a part of a paged cache must hold."""
    view, pdoc = part_view(spec, part), _PartDocument(doc, spec, part)
    out = [p for check in (check_axes_once, check_fused, check_extents) for p in check(view, pdoc)]  # type: ignore[arg-type]
    where = ("parts", part.name, "dims")
    if "T" in part.axes:
        out.append(doc.problem(where, f"part {part.name}: T (token in a chunk) belongs to objects; "
                                      "a paged layout addresses slots with B and N"))
    if part.has("B") != part.has("N"):
        out.append(doc.problem(where, f"part {part.name} has {'B' if part.has('B') else 'N'} without "
                                      f"{'N' if part.has('B') else 'B'}: a part holds slots (B and N) or none"))
    if "L" not in view.axes:
        out.append(doc.problem(where, f"part {part.name} must hold layers: add L to lists or to its dims"))
    out += [doc.problem(("parts", part.name, "sizes", axis), f"a part's sizes fix only its own C; give {axis} in "
                                                             "the top-level sizes, where every part shares it",
                        key=True)
            for axis, _ in part.sizes if axis != "C"]
    return out


def _slot_form_problems(spec: Spec, doc: Document) -> list[Problem]:
    """Some part holds slots, and every part that does writes them the same way."""
    slot_forms = {part.name: "[B, N]" if any(d.is_slot for d in part.dims) else "B and N"
                  for part in spec.parts if part.has_slots}
    out = []
    if not slot_forms:
        out.append(doc.problem(("parts",), "no part holds slots: at least one part needs B and N"))
    if len(set(slot_forms.values())) > 1:
        shown = ", ".join(f"{name} {form}" for name, form in slot_forms.items())
        out.append(doc.problem(("parts",), f"parts address slots differently ({shown}); all use [B, N] "
                                           "or all use B and N"))
    return out


def _shared_size_problems(spec: Spec, doc: Document) -> list[Problem]:
    """The top-level sizes are the parts' shared ones: never C, each of an axis some part has, KV fixed."""
    out = []
    for axis, _ in spec.sizes:
        if axis == "C":
            out.append(doc.problem(("sizes", "C"), "C is each part's own: give it in that part's sizes", key=True))
        elif not any(part_view(spec, p).has(axis) for p in spec.parts):
            out.append(doc.problem(("sizes", axis), f"size given for {axis}, which no part has", key=True))
    if any(part_view(spec, p).has("KV") for p in spec.parts) and spec.size("KV") is None:
        out.append(doc.problem(("parts",), "KV holds K and V: add `sizes: {KV: 2}` so a cache with another "
                                           "K/V extent is refused"))
    return out


def check_rows_as_bytes(spec: Spec, doc: Document) -> list[Problem]:
    """A format-2 cache moves plane by plane as bytes: C, where a part has it, is the
    innermost axis of the part's last dim (so a row's bytes are one run)."""
    if spec.is_simple or not spec.is_paged:
        return []
    out = []
    for part in spec.parts:
        if not part.has("C") or tiled(part.tensor_axes):  # tiles: kvgen.spec.passes.splits
            continue
        last = part.dims[-1].axes if part.dims else ()
        if last[-1:] != ("C",):
            name = f"part {part.name}: " if part.name else ""
            out.append(doc.problem((*part_path(spec, part), "dims"),
                                   f"{name}C must be the innermost axis of the last dim (connectors of format-2 "
                                   "caches move each row as bytes)"))
    return out


#: The passes of parts, in the order their problems are reported.
PASSES: tuple[Pass, ...] = (check_version_features, check_part_level, check_kind_fields, check_parts,
                            check_rows_as_bytes)
