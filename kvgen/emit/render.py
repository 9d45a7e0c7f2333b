"""Render copy plans and the library tables into Python source (Jinja2, StrictUndefined).

Every string a spec contributes reaches a module only as a Python literal (the `py`
filter) or after the schema restricted it to an identifier-like pattern; each module is
parsed and compiled before it may be written.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import jinja2

from kvgen import __version__
from kvgen.errors import BuildError
from kvgen.interface import ABI
from kvgen.plan.models import ModelPlan
from kvgen.plan.package import ConnectorPlan, PackagePlan
from kvgen.spec.library import TEMPLATES, data_dir

DIGEST_PREFIX = "# kvgen-body-sha256: "


#: The line length of generated code (ruff's, pyproject.toml).
LINE = 120


def py_literal(value: object, indent: int | None = None, key: int = 0) -> str:
    """A Python literal for plain data: strings, numbers, None and tuples of them.
    With `indent`, a long tuple gets one item per line (continuation at that indent), and a
    string that would pass the line length after a `key` characters long is split into
    adjacent literals, one per line, in parentheses."""
    if isinstance(value, str) and indent is not None and indent + key + len(str.__repr__(value)) + 1 > LINE:
        return _split_string(value, indent)
    if isinstance(value, (list, tuple)):
        return _tuple_literal(value, indent)
    # The base types' own repr, so that a subclass (an IntEnum, a str subclass) cannot
    # print anything but the plain literal of its value.
    if value is None or isinstance(value, bool):
        return repr(bool(value)) if value is not None else "None"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, str):
        return str.__repr__(value)
    raise TypeError(f"cannot render {type(value).__name__} as a literal")


def _split_string(value: str, indent: int) -> str:
    """A long string as adjacent literals, one per line, in parentheses, broken after a space
    where one falls in the line (a word longer than a line is cut)."""
    pad, width = " " * (indent + 4), LINE - indent - 16
    pieces, line = [], ""
    for word in re.split(r"(?<= )", value):
        while len(word) > width:  # no space to break at
            room = width - len(line)
            line, word = line + word[:room], word[room:]
            pieces.append(line)
            line = ""
        if len(line) + len(word) > width:
            pieces.append(line)
            line = ""
        line += word
    pieces.append(line)
    literals = [str.__repr__(piece) for piece in pieces if piece]
    return "(\n" + "".join(f"{pad}{literal}\n" for literal in literals) + " " * indent + ")"


def _tuple_literal(value: list[object] | tuple[object, ...], indent: int | None) -> str:
    """A tuple on one line, or with `indent` and too long for one, one item per line."""
    items = [py_literal(v) for v in value]
    flat = "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if indent is None or len(flat) <= 72:
        return flat
    pad = " " * (indent + 4)
    return "(\n" + "".join(f"{pad}{item},\n" for item in items) + " " * indent + ")"


def fit_line(text: str, used: int) -> str:
    """`text` after `used` characters of its line: as it is when the line fits, else broken at
    spaces into lines that do, each continued at column `used`."""
    if used + len(text) <= LINE:
        return text
    lines, line = [], ""
    for word in text.split(" "):
        if line and used + len(line) + 1 + len(word) > LINE:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return ("\n" + " " * used).join([*lines, line])


def comment_text(text: str) -> str:
    """Text safe inside a `#` comment: printable ASCII as is, anything else escaped."""
    if text.isascii() and text.isprintable():
        return text
    return ascii(text)


def _bytecode_cache() -> jinja2.BytecodeCache | None:
    """Compiled templates kept between runs (Jinja checks each against its source), in the
    user's cache folder; without a writable one, templates are compiled every run."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvgen" / "jinja"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return jinja2.FileSystemBytecodeCache(str(root)) if os.access(root, os.W_OK) else None


@cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        bytecode_cache=_bytecode_cache(),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["py"] = py_literal
    env.filters["comment"] = comment_text
    env.filters["fit"] = fit_line
    env.globals.update(version=__version__, abi=ABI)
    return env


#: Digests of module bodies this process has compiled: a library rendered again (a check
#: after a build, kvgen's tests) repeats most of its modules, and compiling them is about half
#: of a render. Whether a text compiles is a function of the text.
_COMPILED: set[str] = set()


@cache
def _shipped() -> frozenset[str]:
    """The bodies of the package kvgen ships (generated/) as a build wrote them: each file whose
    recorded digest is its body's was compiled by that build's seal. A user's build repeats all of
    them beside its own modules, so knowing them saves compiling 560 modules (0.5 s) a build."""
    found = set()
    for path in data_dir("generated").glob("*.py"):
        digest = as_built(path.read_text("utf-8"))
        if digest is not None:
            found.add(digest)
    return frozenset(found)


def seal(name: str, text: str) -> str:
    """Check the module parses and compiles, then record a digest of its body so that a
    later hand edit can be told apart from a stale build."""
    digest = body_digest(text)
    if digest not in _COMPILED and digest not in _shipped():
        try:
            compile(text, name, "exec", dont_inherit=True)  # parses to an AST, then to bytecode
        except SyntaxError as exc:
            raise BuildError(f"generated {name} is not valid Python ({exc.msg}, line {exc.lineno}); "
                             "this is a kvgen bug: please report it with the specs involved") from None
        _COMPILED.add(digest)
    return f"{DIGEST_PREFIX}{digest}\n{text}"


def body_digest(body: str) -> str:
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def unseal(text: str) -> tuple[str | None, str]:
    """(recorded digest, body) of a generated file; digest None when the line is missing."""
    first, _, body = text.partition("\n")
    if first.startswith(DIGEST_PREFIX):
        return first[len(DIGEST_PREFIX):], body
    return None, text


def as_built(text: str) -> str | None:
    """The digest of a generated file as a build wrote it (its recorded digest is its body's);
    None for one edited by hand since, or without the digest line."""
    recorded, body = unseal(text)
    return recorded if recorded == body_digest(body) else None


@dataclass(frozen=True)
class ModuleKind:
    """One kind of generated module: the PackagePlan field that lists its plans, and the template
    that renders one plan, which it knows by `name`. A new kind is one entry of MODULE_KINDS."""

    field: str
    template: str
    name: str

    def render(self, plan: object) -> str:
        return environment().get_template(self.template).render(**{self.name: plan})


#: The kinds of module a build writes, one file per plan (named after its `module`).
MODULE_KINDS: tuple[ModuleKind, ...] = (
    ModuleKind("connectors", "connector.py.j2", "c"),
    ModuleKind("kernels", "kernel.py.j2", "k"),
    ModuleKind("transfers", "transfer.py.j2", "t"),
    ModuleKind("models", "model.py.j2", "p"),
)
_BY_FIELD = {k.field: k for k in MODULE_KINDS}
#: The package's own files, each rendered from the whole PackagePlan.
TABLES = {"formats.py": "formats.py.j2", "__init__.py": "init.py.j2"}


def render_connector(c: ConnectorPlan) -> str:
    return _BY_FIELD["connectors"].render(c)


def render_model(p: ModelPlan) -> str:
    return _BY_FIELD["models"].render(p)


def render_package(plan: PackagePlan) -> dict[str, str]:
    """Every file of a generated package, by file name, sealed."""
    files = {f"{m.module}.py": kind.render(m) for kind in MODULE_KINDS for m in getattr(plan, kind.field)}
    files.update({name: environment().get_template(template).render(plan=plan) for name, template in TABLES.items()})
    return {name: seal(name, text) for name, text in sorted(files.items())}
