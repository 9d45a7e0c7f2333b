"""Passes over fields: a part's row or block fields (format 2), their sub-byte element types,
packing, scales and rows of K and V (format 3).

Format 3 adds to a field a sub-byte element type (two values per byte, in a declared
`packing` order), a scale type (ue8m0), and a scale relation (`scales: FIELD, group: G`: one
scale per G consecutive values of FIELD); and lets row fields fill each of K's and V's halves
of a `[KV, C]` row. The rules keep a packed unit whole: a sub-byte field fills whole bytes,
and a scale group covers whole bytes of the values it scales, so a connector moving rows of
bytes never splits one.
"""

from __future__ import annotations

import math

from kvgen.errors import Problem, YamlPath
from kvgen.spec.document import Document
from kvgen.spec.elements import BIT_STREAMS, DTYPES, SCALE_DTYPES
from kvgen.spec.model import ITEMSIZE, Field, FieldsIn, Part, Spec
from kvgen.spec.passes.common import Pass, field_list_path, mapping_at, part_path

#: Field keys only format 3 knows.
V3_FIELD_KEYS = ("packing", "scales", "group")


def _fields_of(spec: Spec) -> list[tuple[Part, int, Field, YamlPath]]:
    """Every field of a paged spec with its YAML path."""
    if not spec.is_paged:
        return []
    return [(part, i, f, (*field_list_path(spec, part), i)) for part in spec.parts for i, f in enumerate(part.fields)]


def check_fields(spec: Spec, doc: Document) -> list[Problem]:
    out: list[Problem] = []
    for part in spec.parts:
        if part.fields and spec.is_paged:
            out += _fields_problems(spec, part, doc)
    return out


def _fields_problems(spec: Spec, part: Part, doc: Document) -> list[Problem]:
    return _field_tree_problems(spec, part, doc) + _field_place_problems(spec, part, doc) + \
        _field_width_problems(spec, part, doc)


def _field_tree_problems(spec: Spec, part: Part, doc: Document) -> list[Problem]:
    """The dims the fields fill (a row's C, or a block's N x C) and the part's one storage dtype."""
    here = part_path(spec, part)
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
                                                "allows B, H, N, C, B, KV, H, N, C, B, [KV, H], N, C and "
                                                "B, N, [KV, H], C)"))
    if len(part.dtypes) != 1:
        out.append(doc.problem((*here, "dtypes") if "dtypes" in mapping_at(doc, here) else (*here, "fields"),
                               f"a part with fields is stored as one dtype (e.g. dtypes: [uint8]); "
                               f"got {len(part.dtypes)}"))
    return out


def _field_place_problems(spec: Spec, part: Part, doc: Document) -> list[Problem]:
    """Each field: a name of its own, a start past the field before it, aligned to its elements."""
    base = field_list_path(spec, part)
    out = []
    seen: dict[str, int] = {}
    end, last = 0, None
    for i, f in enumerate(part.fields):
        path = (*base, i)
        if f.name in seen:
            out.append(doc.problem((*path, "name"), f"field {f.name!r} is named twice (first at index {seen[f.name]})"))
        seen.setdefault(f.name, i)
        raw = mapping_at(doc, path)
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
    return out


def _field_width_problems(spec: Spec, part: Part, doc: Document) -> list[Problem]:
    """The bytes the fields fill make whole storage elements, as many as a fixed C says."""
    if len(part.dtypes) != 1:
        return []  # _field_tree_problems says so
    end = max((f.end for f in part.fields), default=0)
    storage = part.dtypes[0]
    item = ITEMSIZE[storage]
    what = "row" if part.fields_in is FieldsIn.ROW else "token of a block"
    if end % item:
        return [doc.problem(field_list_path(spec, part), f"the fields fill {end} bytes per {what}, not a whole "
                                                         f"number of {item}-byte {storage} elements")]
    if part.size("C") is not None and part.size("C") != end // item:
        return [doc.problem((*part_path(spec, part), "sizes", "C"), f"C is {part.size('C')}, but the fields fill "
                                                                    f"{end} bytes per {what} ({end // item} {storage} "
                                                                    "elements)")]
    return []


#: Format 3: the runs after B that block fields may fill besides [N, C]: every head's cells of a
#: block, or each K and V side's (vLLM NVFP4: [K data | K scales | V data | V scales] per page),
#: cells in the dims' order: (head, slot), or (slot, head) for [N, [KV, H], C], whose page vLLM's
#: NHD NVFP4 views read as the K side's slot-major cells, then the V side's.
BLOCK_CELLS = ((("H",), ("N",), ("C",)), (("KV",), ("H",), ("N",), ("C",)), (("KV", "H"), ("N",), ("C",)),
               (("N",), ("KV", "H"), ("C",)))


def block_cells(part: Part) -> bool:
    """Whether a part's dims after B are one of the format-3 runs of block fields."""
    return tuple(d.axes for d in part.block_run) in BLOCK_CELLS and part.dims[0].axes == ("B",)


def check_v3_features(spec: Spec, doc: Document) -> list[Problem]:
    """Format-3 field keys and element types in an older spec."""
    if spec.version >= 3:
        return []
    out = []
    for _, _, f, path in _fields_of(spec):
        raw = mapping_at(doc, path)
        out += [doc.problem((*path, key), f"field key {key!r} needs kvgen: 3 (this spec says kvgen: {spec.version})",
                            key=True) for key in V3_FIELD_KEYS if key in raw]
        if f.dtype not in DTYPES:
            out.append(doc.problem((*path, "dtype"), f"field dtype {f.dtype} needs kvgen: 3 (this spec says "
                                                     f"kvgen: {spec.version})"))
    return out


def check_sub_byte(spec: Spec, doc: Document) -> list[Problem]:
    """A sub-byte field says its packing and fills whole bytes; packing is for sub-byte fields."""
    out = []
    for _, _, f, path in _fields_of(spec):
        raw = mapping_at(doc, path)
        if f.is_sub_byte and f.packing is None:
            out.append(doc.problem(path, f"field {f.name!r} holds {f.dtype}, {_unit_words(f)}: say which comes "
                                         "first (packing: low_first or high_first)"))
        if not f.is_sub_byte and "packing" in raw:
            out.append(doc.problem((*path, "packing"), f"packing orders the values of a byte; field {f.name!r} "
                                                       f"holds whole {f.itemsize}-byte {f.dtype} values", key=True))
        if f.dtype in BIT_STREAMS and f.packing == "high_first":
            out.append(doc.problem((*path, "packing"), f"field {f.name!r}: {f.dtype} is a little-endian bit stream "
                                                       "(value c at bit 3c); it packs low_first only"))
        if f.is_sub_byte and f.count * f.bits % 8:
            unit = 8 // math.gcd(8, f.bits)
            out.append(doc.problem((*path, "count"), f"field {f.name!r}: {f.count} {f.dtype} values end inside a "
                                                     f"packed unit ({_unit_words(f)}); a packed unit is never split, "
                                                     f"so count must be a multiple of {unit}"))
    return out


def _unit_words(f: Field) -> str:
    """A sub-byte type's packed unit in words: two values per byte, eight in three bytes."""
    unit = 8 // math.gcd(8, f.bits)
    return "two values per byte" if unit == 2 else f"{unit} values in {unit * f.bits // 8} bytes"


def check_scales(spec: Spec, doc: Document) -> list[Problem]:
    """`scales` names a data field of the same list; `group` divides it into whole bytes."""
    out = []
    for part, _, f, path in _fields_of(spec):
        raw = mapping_at(doc, path)
        if ("scales" in raw) != ("group" in raw):
            have, need = ("scales", "group") if "scales" in raw else ("group", "scales")
            out.append(doc.problem((*path, have), f"field {f.name!r} has {have} without {need}: a scale field says "
                                                  "which field it scales and how many values share one scale",
                                   key=True))
            continue
        if f.scales is None or f.group is None:
            continue
        out += _scale_problems(part, f, path, doc)
    return out


def _scale_problems(part: Part, f: Field, path: YamlPath, doc: Document) -> list[Problem]:
    data = next((d for d in part.fields if d.name == f.scales), None)
    if f.dtype not in SCALE_DTYPES:
        return [doc.problem((*path, "dtype"), f"scale field {f.name!r} is {f.dtype}; scales are one of "
                                              f"{', '.join(SCALE_DTYPES)}")]
    if data is None:
        names = ", ".join(d.name for d in part.fields if d is not f)
        return [doc.problem((*path, "scales"), f"field {f.name!r} scales {f.scales!r}, which is not a field of "
                                               f"this list (fields: {names})")]
    if data is f:
        return [doc.problem((*path, "scales"), f"field {f.name!r} cannot scale itself")]
    if data.scales is not None:
        return [doc.problem((*path, "scales"), f"field {f.name!r} scales {data.name!r}, which is itself a scale "
                                               f"field (of {data.scales!r})")]
    out = []
    if data.count % f.group:
        out.append(doc.problem((*path, "group"), f"group {f.group} does not divide the {data.count} values of "
                                                 f"{data.name!r}"))
    elif data.count // f.group != f.count:
        out.append(doc.problem((*path, "count"), f"{data.count} values of {data.name!r} in groups of {f.group} "
                                                 f"need {data.count // f.group} scales, not {f.count}"))
    if f.group * data.bits % 8:
        out.append(doc.problem((*path, "group"), f"a group of {f.group} {data.dtype} values of {data.name!r} ends "
                                                 "inside a packed unit; a group covers whole bytes"))
    return out


def check_kv_rows(spec: Spec, doc: Document) -> list[Problem]:
    """Row fields over a `[KV, C]` last dim (each of K and V holds the fields) need format 3."""
    out = []
    for part in spec.parts:
        if part.fields_in is not FieldsIn.ROW or not part.dims or part.dims[-1].axes != ("KV", "C"):
            continue
        if spec.version < 3:
            out.append(doc.problem((*part_path(spec, part), "dims"), "row fields in each of K's and V's C (a last "
                                                                      "dim [KV, C]) need kvgen: 3"))
    return out


#: The passes of fields, in the order their problems are reported.
PASSES: tuple[Pass, ...] = (check_fields, check_v3_features, check_sub_byte, check_scales, check_kv_rows)
