"""Semantic passes: what the JSON Schema cannot say.

Each pass takes a spec and its document and returns problems located by YAML path;
`check_spec` runs them all so a user sees every problem in a file at once.
Cross-file rules (unique names, aliases, formats) live in `check_library`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from kvgen.errors import Problem, YamlPath, format_path
from kvgen.interface import UNDEFINED
from kvgen.spec.loader import Document
from kvgen.spec.model import PART_LEVEL, Spec
from kvgen.versions import admits_some_release

Pass = Callable[[Spec, Document], list[Problem]]


#: Container levels an engine can hand over: a list per layer, a (K, V) pair.
LIST_AXES = ("L", "KV")


def occurrences(spec: Spec) -> Iterator[tuple[str, YamlPath]]:
    """Every axis letter with the YAML path where it is written."""
    for i, axis in enumerate(spec.lists):
        yield axis, ("lists", i)
    for i, dim in enumerate(spec.dims):
        if dim.is_fused:
            for j, axis in enumerate(dim.axes):
                yield axis, ("dims", i, j)
        elif not dim.is_singleton:
            yield dim.axes[0], ("dims", i)


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
            out.append(doc.problem(_path_of(spec, "T"), "T (token in a chunk) belongs to objects; "
                                                        "a paged layout addresses slots with B and N"))
        missing = [a for a in ("B", "N") if a not in axes]
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
                out.append(doc.problem(_path_of(spec, axis), f"{axis} addresses a paged cache; objects use T"))
    if "C" not in axes:
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
    # P, the list level of parts, is checked with the other format-2 rules (kvgen.spec.passes_v2).
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
        out.append(doc.problem(_path_of(spec, "KV"), "KV holds K and V: add `sizes: {KV: 2}` so a cache "
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


PASSES: tuple[Pass, ...] = (
    check_axes_once, check_kind_axes, check_fused, check_lists,
    check_sizes, check_extents, check_accepts_self, check_reserved_format, check_versions,
    check_given,
)


def check_spec(spec: Spec, doc: Document) -> list[Problem]:
    from kvgen.spec.model import Pack
    from kvgen.spec.passes_models import check_groups_object
    from kvgen.spec.passes_v2 import PASSES_V2, check_version_features
    from kvgen.spec.passes_v3 import PASSES_V3

    if spec.pack is Pack.GROUPS:
        found = (check_version_features, check_groups_object, check_accepts_self, check_reserved_format)
        return [p for check in found for p in check(spec, doc)]
    # A cache of several parts has no top-level dims: its parts are checked one by one there.
    tree = (check_lists,) if spec.is_multipart else PASSES
    return [p for check in (*tree, *PASSES_V2, *PASSES_V3) for p in check(spec, doc)]


def _path_of(spec: Spec, axis: str) -> YamlPath:
    return next((path for a, path in occurrences(spec) if a == axis), ("dims",))


def check_library(entries: Sequence[tuple[Spec, Document]], known_formats: Sequence[str] = ()) -> list[Problem]:
    """Rules across files: unique names, aliases and formats; `accepts` names known formats."""
    out: list[Problem] = []
    names: dict[str, Spec] = {}
    labels: dict[str, Spec] = {}
    formats: dict[str, Spec] = {}
    codes: dict[int, Spec] = {}
    for spec, doc in entries:
        if spec.name in names:
            out.append(doc.problem(("name",), f"name {spec.name!r} is already used by {names[spec.name].source}"))
        names.setdefault(spec.name, spec)
    for spec, doc in entries:
        for i, alias in enumerate(spec.aliases):
            owner = labels.get(alias.casefold()) or (names.get(alias.lower()) if alias.lower() != spec.name else None)
            if owner is not None and owner is not spec:
                out.append(doc.problem(("aliases", i), f"alias {alias!r} is already used by {owner.source}"))
            labels.setdefault(alias.casefold(), spec)  # lookups ignore case, so clashes do too
        if spec.format:
            # Whole and per-layer objects may share a format (KV_MLA_FMT); its code must agree.
            other = formats.setdefault(spec.format, spec)
            if other.code != spec.code:
                out.append(doc.problem(("code",), f"format {spec.format} has code {other.code} in "
                                                  f"{other.source}, not {spec.code}"))
            owner = codes.setdefault(spec.code, spec)
            if owner.format != spec.format:
                out.append(doc.problem(("code",), f"code {spec.code} is already used by "
                                                  f"{owner.format} in {owner.source}"))
    valid = set(formats) | set(known_formats) | {UNDEFINED}
    for spec, doc in entries:
        for i, name in enumerate(spec.accepts):
            if name not in valid:
                out.append(doc.problem(("accepts", i), f"unknown format {name!r}; known: "
                                                       f"{', '.join(sorted(valid))}"))
    from kvgen.spec.passes_models import check_model_library

    return out + check_model_library(entries)

