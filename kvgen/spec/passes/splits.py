"""Passes over split axes (`C/16` with `C%16`: a tiled tree) and token-to-slot ratios (format 3)."""

from __future__ import annotations

from kvgen.errors import Problem, YamlPath
from kvgen.spec.document import Document
from kvgen.spec.elements import Factor, split_of, tiled
from kvgen.spec.model import Part, Spec
from kvgen.spec.passes.common import Pass, part_path


def check_splits(spec: Spec, doc: Document) -> list[Problem]:
    """Split axes (`C/16` with `C%16`): format 3, each with its partner, the whole axis absent, a
    factor that divides a fixed extent, and no fields in a tiled tree."""
    out: list[Problem] = []
    for part in spec.parts:
        where = (*part_path(spec, part), "dims")
        names = part.tensor_axes
        for i, dim in enumerate(part.dims):
            for axis in dim.axes:
                split = split_of(axis)
                if split is not None:  # the schema keeps split axes out of fused dims
                    out += _split_problems(spec, part, (*where, i), axis, split, doc)
        if tiled(names) and part.fields:
            out.append(doc.problem((*part_path(spec, part), "fields"), "a tree with split axes has no fields "
                                                                         "(its rows are not runs of bytes)"))
    return out


def _split_problems(spec: Spec, part: Part, path: YamlPath, axis: str, split: tuple[str, str, Factor],
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
    if isinstance(f, str):
        return out + _named_problems(path, axis, base, doc)
    if f < 2:
        out.append(doc.problem(path, f"{axis} splits by {f}; a split needs a factor of at least 2"))
    fixed = part.size(base) if base == "C" else spec.size(base)
    if fixed is not None and fixed % f and op == "/":
        out.append(doc.problem(path, f"{axis}: the split by {f} does not divide {base} = {fixed}"))
    return out


def _named_problems(path: YamlPath, axis: str, base: str, doc: Document) -> list[Problem]:
    """A factor read from the tensor splits H only: N's and C's factors are fixed where the code
    is generated (a slot's tile and place, a value's words). (A split H has no fixed size: the
    sizes pass refuses one.)"""
    if base != "H":
        return [doc.problem(path, f"{axis}: a named factor (read from the tensor) splits H only; "
                                  f"give {base} a number ({base}/8 with {base}%8)")]
    return []


def check_split_trees(spec: Spec, doc: Document) -> list[Problem]:
    """Split axes in an object: an object keeps every axis whole (kvgen.plan.splits views its dense
    axis as the cache's tile and place). A cache's tree, one or several, may split its axes: a
    tiled one-tree cache is planned as one plane (kvgen.spec.model.Spec.is_simple)."""
    split = [a for d in spec.dims for a in d.axes if split_of(a) is not None]
    if not split or spec.is_paged:
        return []
    return [doc.problem(("dims",), f"an object keeps its axes whole; split axes ({', '.join(split)}) are for "
                                   "a cache's dims")]


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


#: The passes of tiles and ratios, in the order their problems are reported.
PASSES: tuple[Pass, ...] = (check_splits, check_split_trees, check_ratio)
