"""Hostile specs cannot put code into generated modules.

Each `*.yaml` in tests/specs_hostile starts with `# hostile: <what it tries>` and
`# expect: rejected` (the loader refuses it with a SpecError) or `# expect: inert` (it
builds, and its text reaches the generated source only as string literals, comments and
docstrings); `# xfail: <why>` marks a known hole. A single file is built with built-in
companions of the other kind so that it yields connectors; each folder under `multi/` is
built as a whole library, with its expectation in `expect.txt`.

"Inert" is checked on the source and by running it: every identifier in a generated
module (names, attributes, definitions, imports, arguments) is one the built-in build
uses too, or a format / converter name of the library; top-level and class-level
definitions are unique; the values the spec gave come back exactly from the literals;
and importing every module, instantiating every connector and moving a chunk creates no
marker file (hostile summaries try to `touch kvgen_pwned` in the working directory).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import itertools
import random
import re
import sys
import tokenize
from collections import Counter
from functools import cache
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import SCENARIOS, connector_store, make_cache, make_objects, reference_store, same_bits
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgen.emit.build import render, write_atomically
from kvgen.emit.render import py_literal, render_package, unseal
from kvgen.errors import BuildError, SpecError
from kvgen.plan.copy import plan_library
from kvgen.plan.package import plan_package
from kvgen.spec.library import BUILTIN_SPECS, Library, load_library

CORPUS = Path(__file__).parent / "specs_hostile"
SINGLE = sorted(CORPUS.glob("*.yaml"))
MULTI = sorted(p for p in (CORPUS / "multi").iterdir() if p.is_dir())
#: Built-in specs of the other kind, so that a hostile spec yields connectors (whole and layerwise).
COMPANIONS = {
    "paged": [BUILTIN_SPECS / "lmcache/kv_2ltd.yaml", BUILTIN_SPECS / "lmcache/kv_t2d.yaml"],
    "object": [BUILTIN_SPECS / "vllm/flash_attn_nhd.yaml", BUILTIN_SPECS / "vllm/kv_tuple.yaml"],
}
MARKER = "kvgen_pwned"
#: Text of hostile payloads that must never reach a generated module outside a string.
PAYLOAD = ("kvgen_pwned", "os.system", "__import__", "import os", "open(")


def header(text: str) -> dict[str, str]:
    """The `# key: value` lines at the top of a case (continuation lines `#   ...` join on)."""
    out: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        m = re.match(r"^# (\w+): (.*)$", line)
        if m:
            key = m.group(1)
            out[key] = m.group(2).strip()
        elif key and line.startswith("#   "):
            out[key] += " " + line[4:].strip()
        else:
            break
    return out


def case_files(case: Path) -> tuple[dict[str, str], list[Path]]:
    if case.is_dir():
        return header((case / "expect.txt").read_text()), sorted(case.glob("*.yaml"))
    text = case.read_text(encoding="utf-8")
    kind = re.search(r"^kind: (\w+)", text, re.MULTILINE)
    return header(text), [case, *COMPANIONS[kind.group(1) if kind else "paged"]]


# -- what generated source may contain ------------------------------------------------


def identifiers(tree: ast.AST) -> set[str]:
    """Every name the code uses or defines: names, attributes, definitions, imports, arguments."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            out.add(node.arg)
        elif isinstance(node, ast.alias):
            out.update(node.name.split("."))
            if node.asname:
                out.add(node.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.update(node.module.split("."))
    return out


@cache
def builtin_vocabulary() -> frozenset[str]:
    """Identifiers of the built-in build: what the templates write for any library."""
    return frozenset().union(*(identifiers(ast.parse(text)) for text in render().values()))


def library_names(library: Library) -> set[str]:
    """Identifiers a library may add legitimately: its formats (enum members) and converter
    functions named from two object names."""
    names = {fmt for fmt, _ in library.formats()}
    names |= {f"{a.name}__{b.name}" for a, b in itertools.permutations(library.objects, 2)}
    return names


def definitions(body: list[ast.stmt]) -> list[str]:
    out = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.extend(t.id for t in targets if isinstance(t, ast.Name))
    return out


def code_tokens(text: str) -> str:
    """The source with every string literal and comment taken out."""
    kept = [tok.string for tok in tokenize.generate_tokens(StringIO(text).readline)
            if tok.type not in (tokenize.STRING, tokenize.COMMENT)
            and not tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1)]
    return " ".join(kept)


def assert_inert(files: dict[str, str], library: Library) -> None:
    allowed = builtin_vocabulary() | library_names(library)
    for name, text in files.items():
        recorded, body = unseal(text)
        assert recorded is not None, f"{name}: no digest line"
        tree = ast.parse(text, filename=name)
        unexpected = identifiers(tree) - allowed
        assert not unexpected, f"{name}: identifiers no template writes: {sorted(unexpected)}"
        rest = code_tokens(text)
        for payload in PAYLOAD:
            assert payload not in rest, f"{name}: {payload!r} outside string literals and comments"
        dups = [n for n, c in Counter(definitions(tree.body)).items() if c > 1]
        assert not dups, f"{name}: defined more than once at module level: {dups}"
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            dups = [n for n, c in Counter(definitions(cls.body)).items() if c > 1]
            assert not dups, f"{name}: class {cls.name} defines more than once: {dups}"


def assigned_literal(text: str, target: str) -> Any:
    """The literal value assigned to module-level `target`."""
    for node in ast.parse(text).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == target for t in targets):
                assert node.value is not None
                return ast.literal_eval(node.value)
    raise AssertionError(f"no {target} = ... in the module")


def assert_values_round_trip(files: dict[str, str], library: Library) -> None:
    """Spec strings come back from the generated literals exactly as written."""
    layouts = assigned_literal(files["__init__.py"], "LAYOUTS")
    for spec in library.specs:
        facts = layouts[spec.name]
        assert facts["aliases"] == spec.aliases
        if spec.is_paged:
            assert facts["engines"] == spec.engines and facts["lmcache"] == spec.lmcache_format
        else:
            assert facts["format"] == spec.format
    for plan in plan_library(library):
        text = files[f"{plan.module}.py"]
        assert assigned_literal(text, "SUMMARY") == plan.paged.summary


_PACKAGES = itertools.count()


def import_and_run(files: dict[str, str], library: Library, tmp_path: Path,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Write the package, import every module, make every connector, move one chunk through
    each; nothing may run that the templates did not write (no marker file appears)."""
    package = f"kvgen_hostile_{next(_PACKAGES)}"
    root = tmp_path / "pkgroot"
    write_atomically(root / package, files)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(root))
    try:
        pkg = importlib.import_module(package)
        for name in files:
            if name != "__init__.py":
                importlib.import_module(f"{package}.{name[:-3]}")
        sc = SCENARIOS["partial_blocks"]
        for plan in plan_library(library):
            connector = pkg.connector(plan.paged.name, plan.obj.name, "cpu")
            cache_ = make_cache(plan.paged, torch.float32, "cpu")
            connector.bind(cache_)
            mapping = random.Random(plan.module).sample(range(48), sc.seq_len)
            lengths = [sc.ends[0] - sc.starts[0]]
            objs = make_objects(connector, lengths, torch.float32, "cpu", 7, connector.format)
            expected = make_objects(connector, lengths, torch.float32, "cpu", 7)
            connector_store(connector, objs, sc, cache_, torch.tensor(mapping))
            reference_store(plan.paged, plan.obj, cache_, expected, sc, mapping)
            got = [o.tensor for c in objs for o in (c if isinstance(c, list) else [c])]
            want = [o.tensor for c in expected for o in (c if isinstance(c, list) else [c])]
            assert same_bits(got, want), f"{plan.module}: store differs from the reference"
    finally:
        for mod in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[mod]
    assert not (tmp_path / MARKER).exists(), "a generated module ran hostile code"


# -- the corpus -------------------------------------------------------------------------


def _id(case: Path) -> str:
    return case.name if case.is_file() else f"multi/{case.name}"


def test_corpus_is_labelled() -> None:
    assert len(SINGLE) >= 40 and MULTI
    for case in [*SINGLE, *MULTI]:
        head, _ = case_files(case)
        assert head.get("expect") in ("rejected", "inert"), f"{_id(case)}: no '# expect: rejected|inert'"
        assert head.get("hostile"), f"{_id(case)}: no '# hostile:' line saying what it tries"


@pytest.mark.parametrize("case", [*SINGLE, *MULTI], ids=_id)
def test_hostile_spec(case: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      request: pytest.FixtureRequest) -> None:
    head, files = case_files(case)
    if "xfail" in head:
        request.applymarker(pytest.mark.xfail(reason=head["xfail"], strict=False))
    monkeypatch.chdir(tmp_path)
    if head["expect"] == "rejected":
        with pytest.raises(SpecError) as info:
            load_library(files, builtin=False)
        assert all(p.file for p in info.value.problems)
        assert not (tmp_path / MARKER).exists(), "loading a spec ran code"
        return
    library = load_library(files, builtin=False)
    generated = render_package(plan_package(library))
    assert len(generated) > 2, "the case yields no connector; give it a companion it pairs with"
    assert_inert(generated, library)
    assert_values_round_trip(generated, library)
    import_and_run(generated, library, tmp_path, monkeypatch)


def test_keyword_names_only_in_file_names_and_literals() -> None:
    """Keywords and shadowing names become module file names and string literals, nothing else."""
    library = load_library(sorted((CORPUS / "multi" / "keyword_names").glob("*.yaml")), builtin=False)
    files = render_package(plan_package(library))
    assert {"class__import.py", "torch__lambda.py", "print__open.py", "runtime__import.py"} <= set(files)
    hostile = {s.name for s in library.specs}
    for name, text in files.items():
        tree = ast.parse(text)
        assert not identifiers(tree) & (hostile - builtin_vocabulary()), name
        # a shadowed `torch` or `runtime` would change what the connector calls
        assert not any(isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id in ("torch", "runtime")
                       for n in ast.walk(tree)), name


# -- spec file and folder names ---------------------------------------------------------

PAGED_TEXT = """kvgen: 1
name: hp
kind: paged
summary: x
lists: [L]
dims: [KV, B, N, H, C]
sizes: {KV: 2}
"""
OBJECT_TEXT = """kvgen: 1
name: ho
kind: object
summary: x
lists: [L]
dims: [T, KV, [H, C]]
sizes: {KV: 2}
format: HO_FMT
code: 200
"""
CODE = "__import__('os').system('touch kvgen_pwned')"
FILE_NAMES = {
    "newline": f"x\n{CODE}\n#",
    "carriage_return": f"x\r{CODE}\r#",
    "crlf": f"x\r\n{CODE}\r\n#",
    "u2028": f"x\u2028{CODE}",
    "u2029": f"x\u2029{CODE}",
    "u0085": f"x\x85{CODE}",
    "formfeed": f"x\x0c{CODE}",
    "quotes": "x\"\"\"'''\"",
    "backslash": "x\\",
    "future_import": "x\nfrom __future__ import annotations\n" + CODE + "\n#",
}


@pytest.mark.parametrize("where", ["file", "folder"])
@pytest.mark.parametrize("label", list(FILE_NAMES))
def test_hostile_file_and_folder_names(label: str, where: str, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A spec's origin (folder and file name) is written into every module's header comment.
    Names with line breaks must never become code: the build is refused, or inert.

    Today a Python line break (\\n, \\r) in a name ends the header comment and the module
    fails seal()'s compile check (the header's `from __future__` import must come first),
    so the build stops with a BuildError that calls itself a kvgen bug, writing nothing."""
    hostile = FILE_NAMES[label]
    folder = tmp_path / "specs"
    spec_dir = folder / (hostile if where == "folder" else "plain")
    try:
        spec_dir.mkdir(parents=True)
        (spec_dir / (f"{hostile}.yaml" if where == "file" else "paged.yaml")).write_text(PAGED_TEXT)
    except (OSError, ValueError) as exc:
        pytest.skip(f"this file system refuses the name: {exc}")
    (spec_dir / "object.yaml").write_text(OBJECT_TEXT)
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    try:
        files = render([spec_dir], builtin=False)
    except (SpecError, BuildError):
        assert not out.exists()
        assert not (tmp_path / MARKER).exists()
        return
    library = load_library([spec_dir], builtin=False)
    assert_inert(files, library)
    import_and_run(files, library, tmp_path, monkeypatch)


# -- bypassing the loader: what the templates themselves guarantee -----------------------

NASTY = [
    '"""; import os; os.system("touch kvgen_pwned") #',
    "'''\n__import__('os').system('touch kvgen_pwned')\n'''",
    "x\u2028__import__('os')\x85\r\nimport os\\",
    "\\\"\\'\\\\\\n\x00\ud800{{ 7 * 7 }}{% if 1 %}",
    "é" * 300,
]


@pytest.mark.parametrize("text", NASTY, ids=range(len(NASTY)))
def test_free_text_fields_are_literals_even_unchecked(text: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """summary, aliases, engines and accepts reach modules only through py_literal, so even
    text the schema would refuse renders inert (names and formats rely on the schema)."""
    library = load_library(COMPANIONS["paged"] + [BUILTIN_SPECS / "vllm/flash_attn_nhd.yaml"], builtin=False)
    specs = tuple(
        dataclasses.replace(s, summary=text, aliases=(text,), engines=(text, text + "2"))
        if s.is_paged else dataclasses.replace(s, summary=text)
        for s in library.specs)
    library = Library(specs)
    files = render_package(plan_package(library))
    assert_inert(files, library)
    assert_values_round_trip(files, library)
    import_and_run(files, library, tmp_path, monkeypatch)


def test_a_summary_as_long_as_the_schema_allows_keeps_generated_lines_short() -> None:
    """A 200-character summary (the schema's limit) is split between words into literals that
    stay within the generated code's 120 columns, and reads back whole."""
    summary = ("A made-up cache whose summary runs as long as the schema lets it, to check that every "
               "module it reaches keeps its lines short: words, commas, UE8M0 scales, [B, N, H, C].").ljust(200, "!")
    library = load_library(COMPANIONS["paged"] + [BUILTIN_SPECS / "vllm/flash_attn_nhd.yaml"], builtin=False)
    library = Library(tuple(dataclasses.replace(s, summary=summary) for s in library.specs))
    files = render_package(plan_package(library))
    long = [(name, line) for name, text in files.items() if name.endswith(".py")
            for line in text.splitlines() if len(line) > 120]
    assert not long, long[:3]
    module = next(text for name, text in files.items() if name.endswith("__kv_2ltd.py"))
    tree = ast.parse(module)
    (value,) = [n.value for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "SUMMARY"]
    assert ast.literal_eval(value) == summary


# -- py_literal ---------------------------------------------------------------------------

_scalars = st.none() | st.booleans() | st.integers() | st.text()
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=5).map(tuple), max_leaves=20)


def _literal_nodes_only(node: ast.AST) -> bool:
    return all(isinstance(n, (ast.Expression, ast.Constant, ast.Tuple, ast.Load, ast.UnaryOp, ast.USub))
               for n in ast.walk(node))


@settings(max_examples=200, deadline=None)
@given(value=_values, indent=st.none() | st.integers(0, 12))
def test_py_literal_round_trips(value: Any, indent: int | None) -> None:
    text = py_literal(value, indent)
    tree = ast.parse(text, mode="eval")
    assert _literal_nodes_only(tree), text
    assert ast.literal_eval(text) == value


def test_py_literal_ignores_subclass_repr() -> None:
    class Sneaky(str):
        def __repr__(self) -> str:
            return "__import__('os').system('touch kvgen_pwned')"

    class SneakyInt(int):
        def __repr__(self) -> str:
            return "__import__('os')"

    assert py_literal(Sneaky("x")) == "'x'"
    assert py_literal((SneakyInt(3), Sneaky("y"))) == "(3, 'y')"
    with pytest.raises(TypeError):
        py_literal(1.5)
    with pytest.raises(TypeError):
        py_literal({"a": 1})
