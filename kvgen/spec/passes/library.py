"""Rules across the files of a library: unique names, aliases, formats and codes; `accepts`
names known formats; models and groups objects against the layouts they name."""

from __future__ import annotations

from collections.abc import Sequence

from kvgen.errors import Problem
from kvgen.interface import UNDEFINED
from kvgen.spec.document import Document
from kvgen.spec.model import Spec
from kvgen.spec.passes.models import check_model_library


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
    return out + check_model_library(entries)
