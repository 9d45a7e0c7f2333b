"""Semantic passes of spec format 2: parts, fields and packed objects.

`check_spec` in kvgen.spec.passes runs these after the format-1 passes. A cache of several
parts is checked part by part with the format-1 passes (each part is one tensor tree), its
problems located at `parts.NAME.dims[...]`; then the rules that tie the parts together, the
rules of fields and the rules of an object's pack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from kvgen.errors import Problem, YamlPath
from kvgen.spec.document import Document
from kvgen.spec.elements import tiled
from kvgen.spec.model import ITEMSIZE, PART_LEVEL, FieldsIn, Pack, Part, Spec

Pass = Callable[[Spec, Document], list[Problem]]

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
    from kvgen.spec.passes import check_axes_once, check_extents, check_fused

    out: list[Problem] = []
    slot_forms: dict[str, str] = {}
    for part in spec.parts:
        view, pdoc = part_view(spec, part), _PartDocument(doc, spec, part)
        for check in (check_axes_once, check_fused, check_extents):
            out += check(view, pdoc)  # type: ignore[arg-type]
        where = ("parts", part.name, "dims")
        if "T" in part.axes:
            out.append(doc.problem(where, f"part {part.name}: T (token in a chunk) belongs to objects; "
                                          "a paged layout addresses slots with B and N"))
        if part.has("B") != part.has("N"):
            out.append(doc.problem(where, f"part {part.name} has {'B' if part.has('B') else 'N'} without "
                                          f"{'N' if part.has('B') else 'B'}: a part holds slots (B and N) or none"))
        if part.has_slots:
            slot_forms[part.name] = "[B, N]" if any(d.is_slot for d in part.dims) else "B and N"
        if "L" not in view.axes:
            out.append(doc.problem(where, f"part {part.name} must hold layers: add L to lists or to its dims"))
        for axis, _ in part.sizes:
            if axis != "C":
                out.append(doc.problem(("parts", part.name, "sizes", axis),
                                       f"a part's sizes fix only its own C; give {axis} in the top-level sizes, "
                                       "where every part shares it", key=True))
    if not slot_forms:
        out.append(doc.problem(("parts",), "no part holds slots: at least one part needs B and N"))
    if len(set(slot_forms.values())) > 1:
        shown = ", ".join(f"{name} {form}" for name, form in slot_forms.items())
        out.append(doc.problem(("parts",), f"parts address slots differently ({shown}); all use [B, N] "
                                           "or all use B and N"))
    for axis, _ in spec.sizes:
        if axis == "C":
            out.append(doc.problem(("sizes", "C"), "C is each part's own: give it in that part's sizes", key=True))
        elif not any(part_view(spec, p).has(axis) for p in spec.parts):
            out.append(doc.problem(("sizes", axis), f"size given for {axis}, which no part has", key=True))
    if any(part_view(spec, p).has("KV") for p in spec.parts) and spec.size("KV") is None:
        out.append(doc.problem(("parts",), "KV holds K and V: add `sizes: {KV: 2}` so a cache with another "
                                           "K/V extent is refused"))
    return out


def _part_path(spec: Spec, part: Part) -> YamlPath:
    return ("parts", part.name) if spec.is_multipart else ()


def check_rows_as_bytes(spec: Spec, doc: Document) -> list[Problem]:
    """A format-2 cache moves plane by plane as bytes: C, where a part has it, is the
    innermost axis of the part's last dim (so a row's bytes are one run)."""
    if spec.is_simple or not spec.is_paged:
        return []
    out = []
    for part in spec.parts:
        if not part.has("C") or tiled(part.tensor_axes):  # format 3 tiles: kvgen.spec.passes_v3
            continue
        last = part.dims[-1].axes if part.dims else ()
        if last[-1:] != ("C",):
            name = f"part {part.name}: " if part.name else ""
            out.append(doc.problem((*_part_path(spec, part), "dims"),
                                   f"{name}C must be the innermost axis of the last dim (connectors of format-2 "
                                   "caches move each row as bytes)"))
    return out


def _field_list_path(spec: Spec, part: Part) -> YamlPath:
    return (*_part_path(spec, part), "fields", str(part.fields_in))


def check_fields(spec: Spec, doc: Document) -> list[Problem]:
    out: list[Problem] = []
    for part in spec.parts:
        if part.fields and spec.is_paged:
            out += _fields_problems(spec, part, doc)
    return out


def _fields_problems(spec: Spec, part: Part, doc: Document) -> list[Problem]:
    base, here = _field_list_path(spec, part), _part_path(spec, part)
    out = []
    dims = part.dims
    plain = [d.axes[0] if len(d.axes) == 1 else None for d in dims]
    kv_rows = bool(dims) and dims[-1].axes == ("KV", "C")  # format 3: K's C, then V's, each holding the fields
    if part.fields_in is FieldsIn.ROW and plain[-1:] != ["C"] and not kv_rows:
        out.append(doc.problem((*here, "dims"), "row fields fill C: the last dim must be C on its own "
                                                "(or, in format 3, [KV, C])"))
    if part.fields_in is FieldsIn.BLOCK and plain[-3:] != ["B", "N", "C"] \
            and not (spec.version >= 3 and block_cells(part)):
        out.append(doc.problem((*here, "dims"), "block fields fill a block: the dims must end with B, N, C "
                                                "(each block's N x C elements hold the fields' regions; kvgen: 3 also "
                                                "allows B, H, N, C and B, [KV, H], N, C)"))
    if len(part.dtypes) != 1:
        out.append(doc.problem((*here, "dtypes") if "dtypes" in _raw(doc, here) else (*here, "fields"),
                               f"a part with fields is stored as one dtype (e.g. dtypes: [uint8]); "
                               f"got {len(part.dtypes)}"))
    seen: dict[str, int] = {}
    end, last = 0, None
    for i, f in enumerate(part.fields):
        path = (*base, i)
        if f.name in seen:
            out.append(doc.problem((*path, "name"), f"field {f.name!r} is named twice (first at index {seen[f.name]})"))
        seen.setdefault(f.name, i)
        raw = _raw(doc, path)
        if "at" in raw and part.fields_in is FieldsIn.BLOCK:
            out.append(doc.problem((*path, "at"), "at (a byte offset in a row) is for row fields; block fields "
                                                  "are laid out one region after another", key=True))
        elif f.offset < end and last is not None:
            out.append(doc.problem((*path, "at"), f"field {f.name!r} starts at byte {f.offset}, inside field "
                                                  f"{last!r} (bytes {end - part.fields[i - 1].nbytes}..{end - 1})"))
        if f.offset % f.itemsize:
            out.append(doc.problem((*path, "at") if "at" in raw else path,
                                   f"field {f.name!r} starts at byte {f.offset}, not a multiple of its "
                                   f"{f.itemsize}-byte {f.dtype} elements"))
        end, last = max(end, f.end), f.name
    if len(part.dtypes) == 1:
        storage = part.dtypes[0]
        item = ITEMSIZE[storage]
        what = "row" if part.fields_in is FieldsIn.ROW else "token of a block"
        if end % item:
            out.append(doc.problem(base, f"the fields fill {end} bytes per {what}, not a whole number of "
                                         f"{item}-byte {storage} elements"))
        elif part.size("C") is not None and part.size("C") != end // item:
            out.append(doc.problem((*here, "sizes", "C"), f"C is {part.size('C')}, but the fields fill {end} "
                                                          f"bytes per {what} ({end // item} {storage} elements)"))
    return out


#: Format 3: the runs after B that block fields may fill besides [N, C]: every head's cells of a
#: block, or each K and V side's (vLLM NVFP4: [K data | K scales | V data | V scales] per page).
BLOCK_CELLS = ((("H",), ("N",), ("C",)), (("KV",), ("H",), ("N",), ("C",)), (("KV", "H"), ("N",), ("C",)))


def block_cells(part: Part) -> bool:
    """Whether a part's dims after B are one of the format-3 runs of block fields."""
    return tuple(d.axes for d in part.block_run) in BLOCK_CELLS and part.dims[0].axes == ("B",)


def _raw(doc: Document, path: YamlPath) -> Any:
    node = doc.data
    for key in path:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return {}
    return node if isinstance(node, dict) else {}


def check_pack(spec: Spec, doc: Document) -> list[Problem]:
    if spec.is_paged or spec.pack is None:
        return []
    out = []
    if "dtypes" in doc.data:
        out.append(doc.problem(("dtypes",), "a packed object takes its element type from the cache (rows) or "
                                            "holds bytes (regions); leave dtypes out", key=True))
    for axis, _ in spec.sizes:
        if axis != "KV":
            out.append(doc.problem(("sizes", axis), f"a packed object takes {axis} from the cache it is filled "
                                                    "from; its sizes may only say KV: 2", key=True))
    dims = spec.dims
    last = dims[-1].axes if dims else ()
    if spec.pack is Pack.REGIONS:
        out += [doc.problem(("dims", i), "a regions object has no singleton dims: each plane's region is "
                                         "dense over the dims it has")
                for i, d in enumerate(dims) if d.is_singleton]
    if spec.pack is Pack.ROWS:
        for i, d in enumerate(dims):
            bad = [a for a in d.axes if a not in ("L", "T", "C")]
            if bad:
                out.append(doc.problem(("dims", i), f"a rows object holds one row per token: every plane of the "
                                                    f"token one after another in C; {' and '.join(bad)} cannot "
                                                    "appear (planes with KV or H need pack: regions)"))
        if last != ("C",):
            out.append(doc.problem(("dims",), "a rows object ends in C, the row of one token"))
    else:
        if last[-1:] != ("C",):
            out.append(doc.problem(("dims",), "a regions object ends in C: each plane's values are moved as bytes"))
        if not spec.lists and (not dims or dims[0].axes != ("L",)):
            out.append(doc.problem(("dims", 0), "a whole regions object starts with L: each layer holds its "
                                                "planes' regions one after another"))
    return out


PASSES_V2: Sequence[Pass] = (check_version_features, check_part_level, check_kind_fields, check_parts,
                             check_rows_as_bytes, check_fields, check_pack)
