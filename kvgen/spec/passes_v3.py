"""Semantic passes of spec format 3: sub-byte fields, scale fields and rows of K and V.

`check_spec` in kvgen.spec.passes runs these after the format-2 passes. Format 3 adds to a
field a sub-byte element type (two values per byte, in a declared `packing` order), a scale
type (ue8m0), and a scale relation (`scales: FIELD, group: G`: one scale per G consecutive
values of FIELD); and lets row fields fill each of K's and V's halves of a `[KV, C]` row. The
rules keep a packed unit whole: a sub-byte field fills whole bytes, and a scale group covers
whole bytes of the values it scales, so a connector moving rows of bytes never splits one.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgen.errors import Problem, YamlPath
from kvgen.spec.document import Document
from kvgen.spec.elements import DTYPES, SCALE_DTYPES, split_of, tiled
from kvgen.spec.model import Field, FieldsIn, Part, Spec
from kvgen.spec.passes_v2 import Pass, _field_list_path, _part_path, _raw

#: Field keys only format 3 knows.
V3_FIELD_KEYS = ("packing", "scales", "group")


def _fields_of(spec: Spec) -> list[tuple[Part, int, Field, YamlPath]]:
    """Every field of a paged spec with its YAML path."""
    if not spec.is_paged:
        return []
    return [(part, i, f, (*_field_list_path(spec, part), i)) for part in spec.parts for i, f in enumerate(part.fields)]


def check_v3_features(spec: Spec, doc: Document) -> list[Problem]:
    """Format-3 field keys and element types in an older spec."""
    if spec.version >= 3:
        return []
    out = []
    for _, _, f, path in _fields_of(spec):
        raw = _raw(doc, path)
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
        raw = _raw(doc, path)
        if f.is_sub_byte and f.packing is None:
            out.append(doc.problem(path, f"field {f.name!r} holds {f.dtype}, two values per byte: say which comes "
                                         "first (packing: low_first or high_first)"))
        if not f.is_sub_byte and "packing" in raw:
            out.append(doc.problem((*path, "packing"), f"packing orders the values of a byte; field {f.name!r} "
                                                       f"holds whole {f.itemsize}-byte {f.dtype} values", key=True))
        if f.is_sub_byte and f.count * f.bits % 8:
            out.append(doc.problem((*path, "count"), f"field {f.name!r}: {f.count} {f.dtype} values end in half a "
                                                     "byte; a packed byte is never split, so count must be even"))
    return out


def check_scales(spec: Spec, doc: Document) -> list[Problem]:
    """`scales` names a data field of the same list; `group` divides it into whole bytes."""
    out = []
    for part, _, f, path in _fields_of(spec):
        raw = _raw(doc, path)
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
                                                 "inside a packed byte; a group covers whole bytes"))
    return out


def check_kv_rows(spec: Spec, doc: Document) -> list[Problem]:
    """Row fields over a `[KV, C]` last dim (each of K and V holds the fields) need format 3."""
    out = []
    for part in spec.parts:
        if part.fields_in is not FieldsIn.ROW or not part.dims or part.dims[-1].axes != ("KV", "C"):
            continue
        if spec.version < 3:
            out.append(doc.problem((*_part_path(spec, part), "dims"), "row fields in each of K's and V's C (a last "
                                                                      "dim [KV, C]) need kvgen: 3"))
    return out


def check_quant(spec: Spec, doc: Document) -> list[Problem]:
    """`quant` names the quantization in the words of an engine the spec is for (a paged, format-3 cache)."""
    if "quant" not in doc.data:
        return []
    if spec.version < 3:
        return [doc.problem(("quant",), f"field 'quant' needs kvgen: 3 (this spec says kvgen: {spec.version})",
                            key=True)]
    if not spec.is_paged:
        return [doc.problem(("quant",), "quant describes a paged cache's quantization; an object keeps the "
                                        "cache's packed bytes as they are", key=True)]
    families = {e.split("/")[0] for e in spec.engines}
    return [doc.problem(("quant", family), f"quant names engine {family!r}, which engines does not list "
                                           f"({', '.join(sorted(families)) or 'none'})", key=True)
            for family, _ in spec.quant if family not in families]


def check_splits(spec: Spec, doc: Document) -> list[Problem]:
    """Split axes (`C/16` with `C%16`): format 3, each with its partner, the whole axis absent, a
    factor that divides a fixed extent, and no fields in a tiled tree."""
    out: list[Problem] = []
    for part in spec.parts:
        where = (*_part_path(spec, part), "dims")
        names = part.tensor_axes
        for i, dim in enumerate(part.dims):
            for axis in dim.axes:
                split = split_of(axis)
                if split is not None:  # the schema keeps split axes out of fused dims
                    out += _split_problems(spec, part, (*where, i), axis, split, doc)
        if tiled(names) and part.fields:
            out.append(doc.problem((*_part_path(spec, part), "fields"), "a tree with split axes has no fields "
                                                                         "(its rows are not runs of bytes)"))
    return out


def _split_problems(spec: Spec, part: Part, path: YamlPath, axis: str, split: tuple[str, str, int],
                    doc: Document) -> list[Problem]:
    base, op, f = split
    if spec.version < 3:
        return [doc.problem(path, f"split axis {axis} needs kvgen: 3 (this spec says kvgen: {spec.version})")]
    partner = f"{base}{'%' if op == '/' else '/'}{f}"
    out = []
    if op == "/" and partner not in part.tensor_axes:
        out.append(doc.problem(path, f"{axis} is the tile of {base} split by {f}; add {partner}, the place in it"))
    if op == "%" and partner not in part.tensor_axes:
        out.append(doc.problem(path, f"{axis} is the place in a tile of {base}; add {partner}, the tile"))
    if base in part.tensor_axes:
        out.append(doc.problem(path, f"{base} appears whole and split ({axis}); an axis is one or the other"))
    if f < 2:
        out.append(doc.problem(path, f"{axis} splits by {f}; a split needs a factor of at least 2"))
    fixed = part.size(base) if base == "C" else spec.size(base)
    if fixed is not None and fixed % f and op == "/":
        out.append(doc.problem(path, f"{axis}: the split by {f} does not divide {base} = {fixed}"))
    return out


def check_ratio(spec: Spec, doc: Document) -> list[Problem]:
    """A token-to-slot ratio: one of tokens_per_slot and slots_per_token, format 3, paged."""
    given = [k for k in ("tokens_per_slot", "slots_per_token") if k in doc.data]
    out = []
    for key in given:
        if spec.version < 3:
            out.append(doc.problem((key,), f"field {key!r} needs kvgen: 3 (this spec says kvgen: {spec.version})",
                                   key=True))
        elif not spec.is_paged:
            out.append(doc.problem((key,), f"{key} describes how a paged cache stores tokens; an object holds "
                                           "what the cache stores", key=True))
    if len(given) == 2:
        out.append(doc.problem(("slots_per_token",), "give tokens_per_slot (several tokens per slot) or "
                                                     "slots_per_token (several slots per token), not both", key=True))
    return out


PASSES_V3: Sequence[Pass] = (check_v3_features, check_sub_byte, check_scales, check_kv_rows, check_quant, check_splits,
                             check_ratio)
