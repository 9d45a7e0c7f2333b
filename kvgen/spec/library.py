"""Find, load and check a set of spec files: the built-in library plus user folders."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvgen.errors import KVLayoutError, Problem, SpecError
from kvgen.spec.loader import Document, load_document
from kvgen.spec.model import Spec, build_spec
from kvgen.spec.passes import UNDEFINED, check_library, check_spec

#: The kvgen package folder, and the checkout around it (when run from one).
PACKAGE_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = PACKAGE_DIR.parent


def data_dir(name: str) -> Path:
    """A folder of the checkout (specs/, templates/, generated/), or its installed copy
    inside the package (kvgen/specs, ...) when kvgen was installed from a wheel."""
    checkout = REPO_ROOT / name
    return checkout if checkout.is_dir() else PACKAGE_DIR / name


BUILTIN_SPECS = data_dir("specs")
TEMPLATES = data_dir("templates")


@dataclass(frozen=True)
class Library:
    """Every spec of a build, by name, in a stable order."""

    specs: tuple[Spec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {s.name: s for s in self.specs})

    def __getitem__(self, name: str) -> Spec:
        """A spec by its name or an alias (any case), or by an LMCache format name that one
        spec carries; an unknown or ambiguous name raises KVLayoutError saying the valid ones."""
        by_name: dict[str, Spec] = self._by_name  # type: ignore[attr-defined]
        if name in by_name:
            return by_name[name]
        exact = [s for s in self.specs if name in s.aliases]
        if len(exact) == 1:
            return exact[0]
        # Tiers, first match wins: names and aliases in any case, then LMCache's format names.
        key = name.casefold()
        tiers = (
            ("name or alias", lambda s: [s.name, *s.aliases]),
            ("LMCache format name", lambda s: [f for f in (s.format, s.lmcache_format) if f]),
        )
        for what, labels in tiers:
            found = [s for s in self.specs if key in (label.casefold() for label in labels(s))]
            if len(found) == 1:
                return found[0]
            if found:
                raise KVLayoutError(f"{name!r} is the {what} of {len(found)} specs: "
                                    f"{', '.join(s.name for s in found)}; name one of them")
        raise KVLayoutError(f"no layout or object named {name!r} (names and aliases match in any case, "
                            f"as do LMCache format names); known: {', '.join(self.described_names())}")

    def described_names(self) -> list[str]:
        """`vllm_flash_attn_nhd (NHD)`, `kv_2ltd (KV_2LTD)`: every name with its aliases or
        format name, sorted."""
        out = []
        for s in sorted(self.specs, key=lambda s: s.name):
            other = [a for a in (*s.aliases, s.format) if a]
            out.append(s.name + (f" ({', '.join(other)})" if other else ""))
        return out

    @property
    def paged(self) -> tuple[Spec, ...]:
        return tuple(s for s in self.specs if s.is_paged)

    @property
    def objects(self) -> tuple[Spec, ...]:
        return tuple(s for s in self.specs if not s.is_paged)

    def formats(self) -> list[tuple[str, int]]:
        """(name, LMCache code) of every memory format, UNDEFINED first, by code."""
        found = {(s.format, s.code) for s in self.objects if s.format is not None and s.code is not None}
        return [(UNDEFINED, 0), *sorted(found, key=lambda fc: (fc[1], fc[0]))]


SpecFile = tuple[Path, str]  # the file and its origin, named from its spec folder


def spec_files(dirs: Iterable[Path]) -> list[SpecFile]:
    """Every *.yaml / *.yml under `dirs` (or the file itself), in a stable order."""
    files: list[SpecFile] = []
    for d in dirs:
        if d.is_file():
            files.append((d, d.name))
        elif d.is_dir():
            found = sorted(p for p in d.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())
            files.extend((p, f"{d.resolve().name}/{p.relative_to(d).as_posix()}") for p in found)
        else:
            raise FileNotFoundError(f"spec folder {d} does not exist")
    return files


def load_specs(files: Sequence[Path | SpecFile]) -> list[tuple[Spec, Document]]:
    """Load and check each file on its own; raise one SpecError with the problems of all files."""
    problems: list[Problem] = []
    entries: list[tuple[Spec, Document]] = []
    for item in files:
        path, origin = item if isinstance(item, tuple) else (item, item.name)
        try:
            doc = load_document(path)
        except SpecError as exc:
            problems.extend(exc.problems)
            continue
        spec = build_spec(doc, origin)
        found = check_spec(spec, doc)
        problems.extend(found)
        if not found:
            entries.append((spec, doc))
    if problems:
        raise SpecError(problems)
    return entries


def load_library(extra_dirs: Sequence[Path] = (), *, builtin: bool = True) -> Library:
    """The built-in specs plus those under `extra_dirs`, checked across files."""
    dirs = ([BUILTIN_SPECS] if builtin else []) + list(extra_dirs)
    entries = load_specs(spec_files(dirs))
    problems = check_library(entries)
    if problems:
        raise SpecError(problems)
    return Library(tuple(sorted((s for s, _ in entries), key=lambda s: (s.kind != "paged", s.name))))
