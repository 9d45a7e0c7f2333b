"""Passes over a spec's top: axes, lists, sizes, formats and the engines it names.

These are the rules of a spec of one tensor tree (format 1); a cache of several parts runs
`check_axes_once`, `check_fused` and `check_extents` on each part (kvgen.spec.passes.parts).
"""

from __future__ import annotations

from kvgen.errors import Problem, YamlPath, format_path
from kvgen.interface import UNDEFINED
from kvgen.spec.document import Document
from kvgen.spec.elements import EXPLICIT_DTYPES
from kvgen.spec.model import PART_LEVEL, Spec
from kvgen.spec.passes.common import Pass, occurrences, path_of
from kvgen.versions import admits_some_release

#: Container levels an engine can hand over: a list per layer, a (K, V) pair.
LIST_AXES = ("L", "KV")


def check_axes_once(spec: Spec, doc: Document) -> list[Problem]:
    seen: dict[str, YamlPath] = {}
    out = []
    for axis, path in occurrences(spec):
        if axis in seen:
            out.append(doc.problem(path, f"axis {axis} appears twice (first at {format_path(seen[axis])}); "
                                         "each axis may appear once"))
        else:
            seen[axis] = path
    return out


def check_kind_axes(spec: Spec, doc: Document) -> list[Problem]:
    axes, out = spec.axes, []
    if spec.is_paged:
        if "T" in axes:
            out.append(doc.problem(path_of(spec, "T"), "T (token in a chunk) belongs to objects; "
                                                        "a paged layout addresses slots with B and N"))
        missing = [a for a in ("B", "N") if not spec.has(a)]
        if missing:
            out.append(doc.problem(("dims",), f"a paged layout must address slots: missing {' and '.join(missing)} "
                                              "(use B and N, or [B, N] for a folded slot axis)"))
        if "L" not in axes:
            out.append(doc.problem(("dims",), "a paged layout must hold layers: add L to lists or dims"))
    else:
        if "T" not in axes:
            out.append(doc.problem(("dims",), "an object must have a T (token in the chunk) axis"))
        for axis in ("B", "N"):
            if axis in axes:
                out.append(doc.problem(path_of(spec, axis), f"{axis} addresses a paged cache; objects use T"))
    if not spec.has("C"):  # a split C (C/8 with C%8) holds it: kvgen.spec.passes.splits checks that
        out.append(doc.problem(("dims",), "every layout needs a C (content per head) axis"))
    return out


def check_fused(spec: Spec, doc: Document) -> list[Problem]:
    out = []
    for i, dim in enumerate(spec.dims):
        if not dim.is_fused:
            continue
        slot_axes = [a for a in dim.axes if a in ("B", "N")]
        if slot_axes and not dim.is_slot:
            out.append(doc.problem(("dims", i), f"{dim.render()} is not a legal fused axis: B and N fuse only "
                                                "with each other, as [B, N] (block outermost)"))
        if "T" in dim.axes:
            out.append(doc.problem(("dims", i), f"{dim.render()} is not a legal fused axis: T stays its own dim"))
    return out


def check_lists(spec: Spec, doc: Document) -> list[Problem]:
    # P, the list level of parts, is checked with the other format-2 rules (kvgen.spec.passes.parts).
    return [doc.problem(("lists", i), f"{axis} cannot be a list level; lists hold {' or '.join(LIST_AXES)}")
            for i, axis in enumerate(spec.lists) if axis not in (*LIST_AXES, PART_LEVEL)]


def check_sizes(spec: Spec, doc: Document) -> list[Problem]:
    out = []
    for axis, value in spec.sizes:
        path = ("sizes", axis)
        if axis not in spec.axes:
            out.append(doc.problem(path, f"size given for {axis}, which the layout does not have", key=True))
        elif axis in ("B", "T"):
            out.append(doc.problem(path, f"{axis} cannot have a fixed size: it is read from each cache or chunk",
                                   key=True))
        elif axis == "KV" and value != 2:
            out.append(doc.problem(path, f"KV holds K and V, so its size is 2, not {value}"))
    if "KV" in spec.axes and spec.size("KV") is None:
        # Every object format fixes KV at 2: a cache read with KV=3 would fill objects wrongly.
        out.append(doc.problem(path_of(spec, "KV"), "KV holds K and V: add `sizes: {KV: 2}` so a cache "
                                                     "with another K/V extent is refused"))
    return out


def check_extents(spec: Spec, doc: Document) -> list[Problem]:
    """Every extent of a paged layout must be readable from the tensors it describes."""
    if not spec.is_paged:
        return []
    known = {a for a, _ in spec.sizes} | set(spec.lists)
    known |= {d.axes[0] for d in spec.dims if len(d.axes) == 1}
    out = []
    for i, dim in enumerate(spec.dims):
        # A fused group with B or N is either the slot axis [B, N] or check_fused's problem.
        if dim.is_fused and not {"B", "N"} & set(dim.axes):
            # Deduplicated: a repeated axis ([H, H]) is check_axes_once's problem, not this one's.
            unknown = list(dict.fromkeys(a for a in dim.axes if a not in known))
            if len(unknown) > 1:
                out.append(doc.problem(("dims", i), f"cannot tell {' and '.join(unknown)} apart in "
                                                    f"{dim.render()}; give all but one in sizes"))
    return out


def check_accepts_self(spec: Spec, doc: Document) -> list[Problem]:
    if spec.format and spec.format in spec.accepts:
        i = spec.accepts.index(spec.format)
        return [doc.problem(("accepts", i), f"{spec.format} is the object's own format, always accepted; "
                                            "leave it out")]
    return []


def check_reserved_format(spec: Spec, doc: Document) -> list[Problem]:
    """UNDEFINED (code 0) labels a fresh object; no object spec may claim either."""
    out = []
    if spec.format == UNDEFINED:
        out.append(doc.problem(("format",), f"{UNDEFINED} is reserved for fresh objects; name the format"))
    if spec.code == 0:
        out.append(doc.problem(("code",), f"code 0 is reserved for {UNDEFINED}; use 1..255"))
    return out


def check_versions(spec: Spec, doc: Document) -> list[Problem]:
    """A release range belongs to an engine the spec names, and some release lies in it."""
    families = {e.split("/")[0] for e in spec.engines}
    out = []
    for family, span in spec.versions:
        if family not in families:
            named = ", ".join(sorted(families)) or "none"
            out.append(doc.problem(("versions", family), f"versions names engine {family!r}, which engines does "
                                                         f"not list (engines name: {named})", key=True))
        elif not admits_some_release(span):
            out.append(doc.problem(("versions", family), f"no release lies in {span!r}"))
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


def check_explicit_dtypes(spec: Spec, doc: Document) -> list[Problem]:
    """A format-3 storage dtype (float8_e8m0fnu, a UE8M0 scale tensor) needs kvgen: 3, as the scale
    fields it stands beside do."""
    if spec.version >= 3:
        return []
    tops = [("dtypes",)] + [("parts", name, "dtypes") for name in (doc.data.get("parts") or {})]
    out = []
    for path in tops:
        node = doc.data
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        for i, dtype in enumerate(node if isinstance(node, list) else []):
            if dtype in EXPLICIT_DTYPES:
                out.append(doc.problem((*path, i), f"dtype {dtype} needs kvgen: 3 (this spec says kvgen: "
                                                   f"{spec.version})"))
    return out


def check_given(spec: Spec, doc: Document) -> list[Problem]:
    """`given` (the order the engine hands a leaf over) holds exactly the dims of `dims`, each
    once, so reading a handed-over leaf is one fixed permutation."""
    if not spec.given:
        return []
    if not spec.dims:
        return [doc.problem(("given",), "given needs dims (the memory order it permutes); a spec with parts "
                                        "has none", key=True)]
    want = sorted(d.render() for d in spec.dims)
    have = sorted(d.render() for d in spec.given)
    if want != have:
        shown = ", ".join(d.render() for d in spec.dims)
        return [doc.problem(("given",), f"given must be a permutation of dims [{shown}]; it has "
                                        f"[{', '.join(d.render() for d in spec.given)}]")]
    return []


#: The passes of one tensor tree, in the order their problems are reported.
TREE: tuple[Pass, ...] = (
    check_axes_once, check_kind_axes, check_fused, check_lists,
    check_sizes, check_extents, check_accepts_self, check_reserved_format, check_versions,
    check_given,
)
