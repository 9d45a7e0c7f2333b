"""Find, load and check a set of spec files: the built-in library plus user folders."""

from __future__ import annotations

import errno
import re
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvgen.errors import Problem, SpecError, display_path
from kvgen.interface import UNDEFINED
from kvgen.names import Named, described, resolve
from kvgen.spec.building import build_spec
from kvgen.spec.loader import Document, load_document_past_unknown_fields
from kvgen.spec.model import Spec
from kvgen.spec.models import ModelKind, ModelSpec, build_model
from kvgen.spec.passes import check_library, check_model, check_spec

#: The kvgen package folder, and the checkout around it (when run from one).
PACKAGE_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = PACKAGE_DIR.parent


# `name = "kvgen"` at the start of a line of pyproject.toml (tomllib is not in Python 3.10).
_NAMES_KVGEN = re.compile(r"""^\s*name\s*=\s*["']kvgen["']\s*(#.*)?$""", re.MULTILINE)


def source_checkout(package_dir: Path = PACKAGE_DIR) -> Path | None:
    """The source checkout holding the kvgen package folder `package_dir`, or None when
    kvgen is installed (a checkout's pyproject.toml names kvgen, beside specs/ and templates/)."""
    root = package_dir.parent
    pyproject = root / "pyproject.toml"
    if not ((root / "specs").is_dir() and (root / "templates").is_dir() and pyproject.is_file()):
        return None
    try:
        text = pyproject.read_text("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return root if _NAMES_KVGEN.search(text) else None


def data_dir(name: str) -> Path:
    """A folder of the checkout (specs/, templates/, generated/), or its installed copy
    inside the package (kvgen/specs, ...) when kvgen was installed from a wheel."""
    checkout = source_checkout()
    return checkout / name if checkout is not None else PACKAGE_DIR / name


BUILTIN_SPECS = data_dir("specs")
TEMPLATES = data_dir("templates")


#: A loaded file: a layout or object spec, or a model spec.
AnySpec = Spec | ModelSpec


@dataclass(frozen=True)
class Library:
    """Every spec of a build, by name, in a stable order, and the model specs beside them."""

    specs: tuple[Spec, ...]
    models: tuple[ModelSpec, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {s.name: s for s in self.specs})
        names = (Named(s.name, s.aliases, tuple(f for f in (s.format, s.lmcache_format) if f)) for s in self.specs)
        object.__setattr__(self, "_named", tuple(names))

    @classmethod
    def of(cls, specs: Iterable[AnySpec]) -> Library:
        """Layouts first, then objects, each by name; models by name."""
        items = list(specs)
        return cls(tuple(sorted((s for s in items if isinstance(s, Spec)), key=lambda s: (s.kind != "paged", s.name))),
                   tuple(sorted((m for m in items if isinstance(m, ModelSpec)), key=lambda m: m.name)))

    def model(self, name: str) -> ModelSpec:
        """A model spec by name (any case); an unknown name raises KVLayoutError naming the models."""
        return {m.name: m for m in self.models}[resolve(name, [Named(m.name, (), ()) for m in self.models])]

    def __getitem__(self, name: str) -> Spec:
        """A spec by its name, an alias or an LMCache format name (see kvgen.names); an
        unknown or ambiguous name raises KVLayoutError saying the valid ones."""
        by_name: dict[str, Spec] = self._by_name  # type: ignore[attr-defined]
        return by_name[resolve(name, self.named())]

    def named(self) -> list[Named]:
        """Each spec's names (name, aliases, LMCache formats), made once: every lookup reads them."""
        return list(self._named)  # type: ignore[attr-defined]

    def described_names(self) -> list[str]:
        return described(self.named())

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

#: Files of a spec folder that declare transfers between layouts rather than a layout
#: (read by kvgen.spec.transfers).
TRANSFER_FILES = ("transfers.yaml", "transfers.yml")


def spec_files(dirs: Iterable[Path]) -> list[SpecFile]:
    """Every *.yaml / *.yml under `dirs` (or the file itself), in a stable order. A path that
    is no regular file (a FIFO, a device, a socket, a symlink loop) is refused, all of them in
    one SpecError, and never opened: reading a FIFO would wait forever."""
    files: list[SpecFile] = []
    odd: list[Problem] = []
    for d in dirs:
        what = _not_regular(d)
        if what:
            odd.append(_odd_problem(d, what))
        elif d.is_file():
            if d.name not in TRANSFER_FILES:
                files.append((d, d.name))
        elif d.is_dir():
            found = sorted(p for p in d.rglob("*") if p.suffix in (".yaml", ".yml") and p.name not in TRANSFER_FILES)
            odd.extend(_odd_problem(p, what) for p in found if (what := _not_regular(p)))
            files.extend((p, f"{d.resolve().name}/{p.relative_to(d).as_posix()}") for p in found if p.is_file()
                         and not _not_regular(p))
        else:
            raise FileNotFoundError(f"spec folder {d} does not exist")
    if odd:
        raise SpecError(odd)
    return files


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _not_regular(path: Path) -> str | None:
    """What `path` is when it exists but is neither a regular file nor a folder, else None."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        return "a symlink loop" if exc.errno == errno.ELOOP else None
    return next((what for test, what in _KINDS if test(mode)), None)


def _odd_problem(path: Path, what: str) -> Problem:
    return Problem(display_path(path), 1, 1, (), f"{what}, not a spec file (a spec is a regular YAML file)")


def load_each(files: Sequence[Path | SpecFile]) -> tuple[list[tuple[AnySpec, Document]], list[Problem]]:
    """Load and check every file on its own: the good ones, and every problem of the others."""
    problems: list[Problem] = []
    entries: list[tuple[AnySpec, Document]] = []
    for item in files:
        path, origin = item if isinstance(item, tuple) else (item, item.name)
        try:
            doc, unknown = load_document_past_unknown_fields(path)
        except SpecError as exc:
            problems.extend(exc.problems)
            continue
        problems.extend(unknown)
        if doc is None:
            continue
        spec: AnySpec
        if doc.data.get("kind") == ModelKind.MODEL:
            spec = build_model(doc, origin)
            found = check_model(spec, doc)
        else:
            spec = build_spec(doc, origin)
            found = check_spec(spec, doc)
        problems.extend(found)
        if not found and not unknown:
            entries.append((spec, doc))
    return entries, problems


def load_specs(files: Sequence[Path | SpecFile]) -> list[tuple[AnySpec, Document]]:
    """Load and check each file on its own; raise one SpecError with the problems of all files."""
    entries, problems = load_each(files)
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
    return Library.of(s for s, _ in entries)
