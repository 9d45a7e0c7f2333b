"""What tests/test_architecture.py measures in kvgen's source, read with `ast` alone.

- `complexity`: McCabe's cyclomatic complexity counted as radon counts it (radon 6's
  ComplexityVisitor): 1, plus 1 per `if`, `elif`, conditional expression, `assert` (whatever its test), `for`,
  `while` (and 1 more for its `else`), `except` handler (and 1 for a `try`'s `else`),
  comprehension `for` and each of its `if`s, each `and`/`or` operand after the first, and per
  `match` case (a trailing wildcard case not counted). A function nested in another is
  measured on its own and adds nothing to the outer one; a lambda's body counts in the
  function it is written in.
- `parameters`: every parameter, `*args` and `**kwargs` one each, a method's first `self`
  or `cls` not counted.
- `import_sites`: every import, at top level or inside a function, with the function it is
  in and whether it lies under `if TYPE_CHECKING:` (then it never runs: it names types for
  annotations only, and neither loads a module nor closes a cycle).
"""

from __future__ import annotations

import ast
import functools
import sys
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvgen"
SOURCES = sorted(PACKAGE.rglob("*.py"))
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


@functools.cache
def source_tree(path: Path) -> ast.Module:
    """The parsed source of `path`, parsed once: every rule walks every module (read only)."""
    return ast.parse(path.read_text("utf-8"))


@functools.cache
def source_nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of `path`'s tree, walked once: the import and device rules both look at every
    node of every generated module."""
    return tuple(ast.walk(source_tree(path)))


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{line}"


MODULES = {module_name(p): p for p in SOURCES}
#: The built package (generated/, installed as kvgen.generated): read for what importing it loads.
GENERATED = PACKAGE.parent / "generated" / "__init__.py"


@dataclass(frozen=True)
class Function:
    """One function or method, named `module:qualname` (`kvgen.tp:plan`,
    `kvgen.runtime.model.connector:ModelConnector._run`)."""

    path: Path
    qualname: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    in_class: bool

    @property
    def key(self) -> str:
        return f"{module_name(self.path)}:{self.qualname}"

    @property
    def where(self) -> str:
        return where(self.path, self.node.lineno)


def _functions_in(path: Path, body: list[ast.stmt], prefix: str, in_class: bool) -> Iterator[Function]:
    for node in body:
        if isinstance(node, FUNCTIONS):
            yield Function(path, prefix + node.name, node, in_class)
            yield from _functions_in(path, node.body, f"{prefix}{node.name}.", False)
        elif isinstance(node, ast.ClassDef):
            yield from _functions_in(path, node.body, f"{prefix}{node.name}.", True)
        else:  # functions defined under an `if` or a `try` at this level
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, [])
                stmts = [s for h in inner for s in h.body] if field == "handlers" else inner
                yield from _functions_in(path, stmts, prefix, in_class)


def functions(paths: list[Path] = SOURCES) -> list[Function]:
    return [f for p in paths for f in _functions_in(p, source_tree(p).body, "", False)]


def _node_complexity(node: ast.AST) -> int:
    if isinstance(node, (*FUNCTIONS, ast.ClassDef)):
        return 0  # measured on its own
    if isinstance(node, ast.Assert):
        return 1  # radon counts an assert as one and looks no further into it
    if isinstance(node, (ast.If, ast.IfExp)):
        own = 1
    elif isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
        own = 1 + bool(node.orelse)
    elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
        own = len(node.handlers) + bool(node.orelse)
    elif isinstance(node, ast.BoolOp):
        own = len(node.values) - 1
    elif isinstance(node, ast.comprehension):
        own = 1 + len(node.ifs)
    elif isinstance(node, ast.Match):
        wildcard = any(getattr(c.pattern, "pattern", False) is None for c in node.cases)
        own = max(1, len(node.cases) - wildcard)
    else:
        own = 0
    return own + sum(_node_complexity(child) for child in ast.iter_child_nodes(node))


def complexity(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return 1 + sum(_node_complexity(stmt) for stmt in node.body)


def parameters(f: Function) -> int:
    a = f.node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args)]
    count = len(names) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    return count - (f.in_class and bool(names) and names[0] in ("self", "cls"))


def classes(paths: list[Path] = SOURCES) -> list[tuple[str, str]]:
    """(name, file:line) of every class defined anywhere in `paths`."""
    return [(node.name, where(p, node.lineno)) for p in paths
            for node in source_nodes(p) if isinstance(node, ast.ClassDef)]


# ----------------------------------------------------------------------------- imports


@dataclass(frozen=True)
class ImportSite:
    """One `import` statement naming `target` (a kvgen module, or the top-level name of another package)."""

    path: Path
    line: int
    target: str
    function: str | None  # `module:qualname` of the function it is in; None at module level
    commented: bool  # a comment on its line, on another line of its run of imports, or just above the run
    typing_only: bool = False  # under `if TYPE_CHECKING:`: never runs

    @property
    def where(self) -> str:
        return where(self.path, self.line)


def resolve(name: str, attrs: tuple[str, ...] = ()) -> list[str]:
    """The modules an import of `name` (with `from name import attrs`) runs, kvgen's by module name."""
    if not name.startswith("kvgen"):
        return [name.split(".")[0]]
    found = [f"{name}.{a}" for a in attrs if f"{name}.{a}" in MODULES or f"{name}.{a}" == "kvgen.generated"]
    if len(found) < len(attrs) or not attrs:
        found.append(name)  # the module itself, or a package's __init__ for the names it defines
    return found


def _comment_lines(path: Path) -> set[int]:
    with path.open("rb") as f:
        return {t.start[0] for t in tokenize.tokenize(f.readline) if t.type == tokenize.COMMENT}


def _typing_only(stmt: ast.stmt) -> bool:
    test = getattr(stmt, "test", None) if isinstance(stmt, ast.If) else None
    return isinstance(test, (ast.Name, ast.Attribute)) and ast.unparse(test).endswith("TYPE_CHECKING")


def _import_runs(body: list[ast.stmt], typing_only: bool = False
                 ) -> Iterator[tuple[list[ast.Import | ast.ImportFrom], bool]]:
    """Each run of consecutive import statements, and whether it lies under `if TYPE_CHECKING:`."""
    run: list[ast.Import | ast.ImportFrom] = []
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            run.append(stmt)
            continue
        if run:
            yield run, typing_only
            run = []
        yield from _import_runs(getattr(stmt, "body", []), typing_only or _typing_only(stmt))
        for field in ("orelse", "finalbody"):
            yield from _import_runs(getattr(stmt, field, []), typing_only)
        for handler in getattr(stmt, "handlers", []):
            yield from _import_runs(handler.body, typing_only)
    if run:
        yield run, typing_only


def _owners(path: Path, tree: ast.Module) -> dict[int, str]:
    """The innermost function of each line of `path` that lies in a function."""
    owner: dict[int, str] = {}
    for f in sorted(_functions_in(path, tree.body, "", False), key=lambda f: f.node.lineno):
        for line in range(f.node.lineno, (f.node.end_lineno or f.node.lineno) + 1):
            owner[line] = f.key  # nested functions come later and overwrite their lines
    return owner


def import_sites(path: Path) -> list[ImportSite]:
    tree = source_tree(path)
    comments, owner = _comment_lines(path), _owners(path, tree)
    sites = []
    for run, typing_only in _import_runs(tree.body):
        lines = set(range(run[0].lineno - 1, (run[-1].end_lineno or run[-1].lineno) + 1))
        commented = bool(lines & comments)
        for stmt in run:
            if isinstance(stmt, ast.Import):
                targets = [t for alias in stmt.names for t in resolve(alias.name)]
            elif stmt.level or not stmt.module:
                continue  # kvgen writes absolute imports only
            else:
                targets = resolve(stmt.module, tuple(a.name for a in stmt.names))
            sites += [ImportSite(path, stmt.lineno, t, owner.get(stmt.lineno), commented, typing_only)
                      for t in targets]
    return sites


@functools.cache
def sites() -> tuple[ImportSite, ...]:
    """Every import in the package, parsed when a rule first asks (not when a test module is
    collected: every pytest worker collects every module)."""
    return tuple(s for p in SOURCES for s in import_sites(p))


@functools.cache
def _top_level() -> dict[str, list[str]]:
    """Each module's module-level imports (kvgen.generated's too), by module name."""
    found: dict[str, list[str]] = {}
    for site in [*sites(), *import_sites(GENERATED)]:
        if site.function is None and not site.typing_only:
            name = "kvgen.generated" if site.path == GENERATED else module_name(site.path)
            found.setdefault(name, []).append(site.target)
    return found


def parents(module: str) -> list[str]:
    """The packages Python runs before `module` (`kvgen`, `kvgen.tools`, ... for kvgen.tools.bench.run)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in MODULES]


def loads_at_import(module: str) -> set[str]:
    """Every module importing `module` runs: its packages and its module-level imports, transitively."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += parents(m) + _top_level().get(m, [])
    return seen


def third_party(names: set[str]) -> set[str]:
    return {n for n in names if not n.startswith("kvgen") and n not in sys.stdlib_module_names}


def cycles(graph: dict[str, list[ImportSite]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of one importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for site in graph[m]:
            if site.target not in index:
                visit(site.target)
                low[m] = min(low[m], low[site.target])
            elif site.target in stack:
                low[m] = min(low[m], index[site.target])
        if low[m] == index[m]:
            part = []
            while not part or part[-1] != m:
                part.append(stack.pop())
            if len(part) > 1 or any(s.target == m for s in graph[m]):
                found.append(sorted(part))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return found
