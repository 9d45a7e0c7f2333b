"""Spec sets as the read-only commands see them.

`validate` runs build's checks (each file on its own, then the cross-file rules against the
built-ins) and reports every problem of every file at once. `explain` and `list` leave out
the user files that have problems, so one spec being edited does not hide the others; the
caller warns about what was left out. `build` and `check` stay strict (kvgen.spec.library).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvgen.errors import Problem, display_path
from kvgen.spec.library import BUILTIN_SPECS, AnySpec, Library, SpecFile, load_each, load_specs, spec_files
from kvgen.spec.loader import Document
from kvgen.spec.model import Spec
from kvgen.spec.passes import check_library

Entry = tuple[AnySpec, Document]


def user_files(paths: Sequence[Path]) -> tuple[list[Entry], list[SpecFile]]:
    """The built-in entries, and the spec files under `paths` that are not built-in files
    (so `validate specs/` checks the built-ins once, not against themselves)."""
    builtin_files = spec_files([BUILTIN_SPECS])
    builtin = {p.resolve() for p, _ in builtin_files}
    return load_specs(builtin_files), [f for f in spec_files(paths) if f[0].resolve() not in builtin]


@dataclass
class Validation:
    ok: list[AnySpec] = field(default_factory=list)  # specs of the given files without problems
    problems: list[Problem] = field(default_factory=list)
    files: int = 0  # spec files found under the given paths
    warnings: list[str] = field(default_factory=list)  # legal, but likely not what the user meant


#: What names or documents a layout without changing it: two specs equal but for these are one layout.
_NAMING = {"name": "", "summary": "", "aliases": (), "lmcache_format": None, "engines": (), "versions": (),
           "source": "", "origin": "", "digest": "", "code": None, "accepts": ()}


def twins(builtin: Sequence[Entry], entries: Sequence[Entry]) -> list[str]:
    """A warning for each user spec that describes a built-in layout under another name (a
    copy to start from, left unchanged): the built-in's connectors already move it."""
    def key(spec: AnySpec) -> object:
        return dataclasses.replace(spec, **_NAMING) if isinstance(spec, Spec) else None

    known = [(key(s), s) for s, _ in builtin if isinstance(s, Spec)]
    out = []
    for spec, doc in entries:
        mine = key(spec)
        same = next((b for k, b in known if mine is not None and k == mine), None)
        if same is not None:
            also = f" ({', '.join(same.aliases)})" if same.aliases else ""
            out.append(f"{doc.file}: {spec.name} describes the same layout as the built-in {same.name}{also}; "
                       "use that name (or alias) instead")
    return out


def twin_warnings(paths: Sequence[Path]) -> list[str]:
    """twins() for the user spec files under `paths` that load without problems."""
    builtin, files = user_files(paths)
    return twins(builtin, load_each(files)[0])


def validate(paths: Sequence[Path]) -> Validation:
    """Every problem `kvgen build --specs PATHS` would report, for files and folders alike."""
    builtin, files = user_files(paths)
    asked = {p.resolve() for p, _ in spec_files(paths)}
    entries, problems = load_each(files)
    problems += check_library([*builtin, *entries])
    bad = {p.file for p in problems}
    ok = [s for s, d in [*builtin, *entries] if Path(s.source).resolve() in asked and d.file not in bad]
    return Validation(ok, problems, len(asked), twins(builtin, [e for e in entries if e[1].file not in bad]))


@dataclass
class Lenient:
    library: Library
    problems: list[Problem]  # every problem of the files left out
    left_out: list[str]  # those files, as shown in the problems


def load_lenient(extra: Sequence[Path]) -> Lenient:
    """The built-ins plus every user spec that build would accept on its own merits; a user
    file with a problem, or one that clashes with the built-ins or an earlier user file, is
    left out (never a built-in)."""
    builtin, files = user_files(extra)
    entries, problems = load_each(files)
    # Formats any candidate defines, so an `accepts` naming a later file's format is not a clash.
    formats = [s.format for s, _ in entries if s.format]
    kept: list[Entry] = []
    for entry in entries:
        found = check_library([*builtin, *kept, entry], known_formats=formats)
        if found:
            problems += found
        else:
            kept.append(entry)
    # Leaving a file out can orphan another's `accepts`: drop those too, until nothing clashes.
    while found := check_library([*builtin, *kept]):
        problems += found
        bad = {p.file for p in found}
        if not any(d.file in bad for _, d in kept):
            break  # not a user file's problem: the same as build reports, nothing more to leave out
        kept = [(s, d) for s, d in kept if d.file not in bad]
    left_out = set(_shown(files)) - {d.file for _, d in kept}
    return Lenient(Library.of(s for s, _ in [*builtin, *kept]), problems, sorted(left_out))


def _shown(files: Sequence[SpecFile]) -> list[str]:
    """The files as problems name them."""
    return [display_path(p) for p, _ in files]
