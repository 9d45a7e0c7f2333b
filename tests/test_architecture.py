"""The pipeline's shape: stages import one way, the generator never imports torch, and
the runtime never imports a generator stage. The code rules (what is measured, and how, is in
tests/code_rules.py; the tests of the rules themselves are in tests/test_code_rules.py):

- no import cycles among kvgen's modules, counting imports inside functions;
- an import inside a function only defers an optional or heavy dependency, and says so in
  a comment (see test_function_level_imports_only_defer_heavy_dependencies);
- no function above McCabe complexity 15, counted as radon counts it;
- no function with more than 6 parameters, except the public APIs in ENGINE_SIGNATURES;
- no two classes of the same name in the package;
- one name per kind: no module (or template) is a format or version sibling of another
  (`X_parts`, `parts_X`, `X_v2`), none is named for a kind beside another kind's module of the
  same job (`transfer_X`, `model_X` beside `X`), and after the spec stage no module is `parts`.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path

import pytest
from code_rules import (
    MODULES,
    PACKAGE,
    SOURCES,
    ImportSite,
    classes,
    complexity,
    cycles,
    functions,
    loads_at_import,
    module_name,
    parameters,
    sites,
    source_nodes,
    third_party,
)

#: Shared, torch-free modules every stage may import.
CORE = {"kvgen", "kvgen.errors", "kvgen.notation", "kvgen.names", "kvgen.interface", "kvgen.versions"}
#: What each part of kvgen may import from kvgen, besides CORE and itself.
ALLOWED = {
    "spec": set(),
    "plan": {"spec"},
    "emit": {"spec", "plan"},
    "runtime": set(),
    # The oracle reads specs and runs connectors, but never sees how they were planned.
    "oracle": {"spec", "runtime"},
    "tools": {"spec", "plan", "emit", "runtime", "oracle", "generated", "integrations", "remote"},
    # Other systems' contracts (LMCache) on top of the generated connectors; detection reads
    # the generated package's facts.
    "integrations": {"runtime", "generated", "remote"},
    # P/D transfers: a cache's description and the wire plan, from the runtime's layout facts.
    "remote": {"runtime", "generated"},
    "core": set(),
}
TORCH_FREE = {"spec", "plan", "emit", "core"}


def stage_of(module: str) -> str:
    if module == "kvgen.__main__":
        return "tools"  # `python -m kvgen` is the CLI
    parts = module.split(".")
    if module in CORE or len(parts) < 2:
        return "core"
    return parts[1] if parts[1] in ALLOWED or parts[1] == "generated" else "core"


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at top level or inside functions."""
    found: set[str] = set()
    for node in source_nodes(path):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_pipeline(path: Path) -> None:
    here = stage_of(module_name(path))
    wrong = []
    for name in imports(path):
        if name == "torch" or name.startswith("torch."):
            if here in TORCH_FREE:
                wrong.append(f"{name} (no torch in {here})")
            continue
        if not name.startswith("kvgen"):
            continue
        target = stage_of(name)
        # `from kvgen import runtime` names a stage through the package root.
        if name.startswith("kvgen.") and name.count(".") == 1 and name.split(".")[1] in ALLOWED:
            target = name.split(".")[1]
        if target in (here, "core") or target in ALLOWED[here]:
            continue
        wrong.append(f"{name} ({here} may not import {target})")
    assert not wrong, f"{path.relative_to(PACKAGE)} imports against the pipeline: {', '.join(sorted(wrong))}"


def test_building_the_library_never_imports_torch(tmp_path: Path) -> None:
    """One fresh interpreter imports the generator's stages, then builds (kvgen.emit.build.build,
    through `kvgen build`: it loads, plans and renders), checks and explains, from a folder
    outside the repository: no torch, no kvgen.runtime. (test_build_safety.py's
    generator-never-imports-torch check is this one.)"""
    out = tmp_path / "out"
    code = ("import sys\n"
            "from kvgen.emit.build import check, render\n"
            "from kvgen.plan.copy import plan_library\n"
            "from kvgen.spec.library import load_library\n"
            "from kvgen.tools.cli import main\n"
            f"assert main(['build', '--out', {str(out)!r}]) == 0\n"
            f"assert check({str(out)!r}).ok\n"
            "assert main(['explain', 'NHD']) == 0\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'kvgen.runtime')))\n"
            "assert not loaded, loaded\n")
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr


def test_generated_and_runtime_code_import_no_generator_stage() -> None:
    generated = PACKAGE.parent / "generated"
    for path in [*sorted(generated.glob("*.py")), *sorted((PACKAGE / "runtime").glob("*.py"))]:
        stages = {stage_of(n) for n in imports(path) if n.startswith("kvgen")}
        assert stages <= {"runtime", "core"}, f"{path.name} imports {sorted(stages)}"


def test_closed_vocabularies_are_enums() -> None:
    from kvgen.plan.convert import Conversion, Direction, plan_converters
    from kvgen.plan.copy import Mode, PathKind, plan_library
    from kvgen.spec.library import load_library
    from kvgen.spec.model import Kind, Vocabulary

    library = load_library()
    plans = plan_library(library)
    assert all(isinstance(s.kind, Kind) for s in library.specs)
    assert {p.mode for p in plans} == set(Mode) and {p.path for p in plans} == set(PathKind)
    converters = plan_converters(library)
    assert {c.kind for c in converters} <= set(Conversion) and {c.direction for c in converters} <= set(Direction)
    assert all(issubclass(e, Vocabulary) for e in (Kind, Mode, PathKind, Conversion, Direction))
    assert str(Mode.WHOLE) == "whole" == Mode.WHOLE  # prints and compares as its word


def test_the_build_loops_over_registered_kinds() -> None:
    """A build's connectors are PAIR_KINDS' pairs, kind by kind, each planned by the kind that
    found it; its files are one per plan of each MODULE_KINDS field, plus the package's tables."""
    from kvgen.emit.render import MODULE_KINDS, TABLES, render_package
    from kvgen.plan.package import PAIR_KINDS, kind_of, plan_package
    from kvgen.spec.library import load_library

    library = load_library()
    plan = plan_package(library)
    assert [c.module for c in plan.connectors] == [p.module for k in PAIR_KINDS for p in k.pairs(library)]
    assert [k.module for k in plan.kernels] == [f"{c.module}_triton" for c in plan.connectors]
    found = {k.name: [c.module for c in plan.connectors if kind_of(c.copy) is k] for k in PAIR_KINDS}
    assert all(found.values()), f"a kind with no connector in the built-in library: {found}"
    files = render_package(plan)
    assert set(files) == {f"{m.module}.py" for k in MODULE_KINDS for m in getattr(plan, k.field)} | set(TABLES)



#: A name that marks a module as another format or version of a kind's module: each kind has
#: its own module at every stage instead (kvgen.plan.package's PAIR_KINDS: layouts, planes).
SIBLING_NAME = re.compile(r"^(?:.+_(?:parts|v\d+)|(?:parts|v\d+)_.+)$")
TEMPLATES = PACKAGE.parent / "templates"


def test_no_module_is_a_format_sibling_of_another() -> None:
    """One name per kind at every stage: a kind's module is named for what it does (a package
    with one module per kind where a job has several kinds, as oracle/reference has), never as a
    `_parts` / `parts_` / `_v2` sibling of another kind's module."""
    names = [p.relative_to(PACKAGE.parent) for p in [*SOURCES, *TEMPLATES.glob("*.j2")]]
    found = [str(n) for n in names if SIBLING_NAME.match(n.name.split(".")[0])]
    assert not found, f"modules named as a sibling of another kind's: {found}"
    # The tests too, by what follows `test_` (tests/test_planes_connectors.py, not test_parts_connectors.py).
    tests = [p.name for p in Path(__file__).parent.glob("test_*.py")]
    found = [n for n in tests if SIBLING_NAME.match(n.removeprefix("test_").removesuffix(".py"))]
    assert not found, f"test modules named as a sibling of another kind's: {found}"


def test_the_sibling_rule_names_the_siblings_kinds_replaced() -> None:
    """The format-2 siblings this rule stops (issue 21) are sibling names; kind modules are not."""
    assert all(SIBLING_NAME.match(n) for n in ("passes_v2", "kernels_parts", "kernel_parts", "parts_fact"))
    assert not any(SIBLING_NAME.match(n) for n in ("parts", "planes", "facts_planes", "transfer_reference"))

#: A kind's word as a module name's prefix (`transfer_scenarios`, `model_scenarios`): the kinds
#: PAIR_KINDS names (layouts, planes), transfers and models, and the spec's word for planes.
KIND_PREFIX = re.compile(r"^(layouts?|planes?|parts?|transfers?|models?)_(.+)$")
#: The spec language's word: `parts:` and kvgen/spec/passes/parts.py stay; every later stage calls
#: the kind of caches of several parts or fields `planes`.
SPEC_STAGE = PACKAGE / "spec"


def _siblings(paths: Collection[Path]) -> dict[Path, set[str]]:
    """The names in each folder: its modules and templates, and its packages (by their __init__)."""
    names: dict[Path, set[str]] = {}
    for p in paths:
        if p.name == "__init__.py":
            names.setdefault(p.parent.parent, set()).add(p.parent.name)
        else:
            names.setdefault(p.parent, set()).add(p.name.split(".")[0])
    return names


def kind_name_problems(paths: Collection[Path]) -> list[str]:
    """The modules among `paths` named for a kind beside another kind's module of the same job
    (`transfer_X` or `model_X` next to a module or package `X` in one folder: the job is a package
    `X/` with one module per kind, as oracle/scenarios and oracle/reference are), and those named
    `parts` outside the spec stage (the plan, runtime, ... name the planes kind `planes`)."""
    names, found = _siblings(paths), []
    for p in sorted(paths):
        stem = p.name.split(".")[0]
        prefixed = KIND_PREFIX.match(stem)
        if prefixed and prefixed.group(2) in names.get(p.parent, set()):
            found.append(f"{p}: the {prefixed.group(1)} kind's {prefixed.group(2)} beside the module "
                         f"{prefixed.group(2)}: make {prefixed.group(2)} a package with one module per kind")
        if stem == "parts" and SPEC_STAGE not in p.parents:
            found.append(f"{p}: the planes kind is `planes` after the spec stage, not `parts`")
    return found


def test_no_module_is_named_for_a_kind_beside_another_kinds() -> None:
    """One name per kind at every stage: no `transfer_X` / `model_X` beside `X`, no plan or
    runtime module `parts`."""
    found = kind_name_problems([*SOURCES, *TEMPLATES.glob("*.j2")])
    assert not found, "\n".join(found)


def test_the_kind_name_rule_names_the_modules_it_replaced() -> None:
    """The layout before issue 21's item 3 offends on each renamed module; today's does not, and a
    kind's module put back beside the package of its job offends again."""
    oracle, plan, runtime = PACKAGE / "oracle", PACKAGE / "plan", PACKAGE / "runtime"
    before = [oracle / "scenarios.py", oracle / "transfer_scenarios.py", oracle / "model_scenarios.py",
              oracle / "reference" / "__init__.py", plan / "parts.py", plan / "copy.py",
              PACKAGE / "spec" / "passes" / "parts.py", runtime / "model.py", runtime / "model_checks.py"]
    found = kind_name_problems(before)
    assert [f.split(":")[0] for f in found] == [str(oracle / "model_scenarios.py"),
                                               str(oracle / "transfer_scenarios.py"), str(plan / "parts.py")]
    scenarios = oracle / "scenarios"
    after = [scenarios / "__init__.py", scenarios / "layouts.py", scenarios / "transfers.py", scenarios / "models.py",
             plan / "planes.py", PACKAGE / "spec" / "passes" / "parts.py", runtime / "model_checks.py"]
    assert kind_name_problems(after) == []
    assert kind_name_problems([*after, oracle / "transfer_scenarios.py", runtime / "parts.py"]) == [
        f"{oracle / 'transfer_scenarios.py'}: the transfer kind's scenarios beside the module scenarios: "
        "make scenarios a package with one module per kind",
        f"{runtime / 'parts.py'}: the planes kind is `planes` after the spec stage, not `parts`"]

def suffix_sibling_problems(paths: Collection[Path]) -> list[str]:
    """Modules named `X_Y` beside a module or package `X` in one folder (`native_transfer` beside
    `native`, `model_checks` beside `model`): one job split by a suffix, where the job is a package
    `X/` whose modules are named for their parts (runtime/model/checks, runtime/transfer/compiled)."""
    names, found = _siblings(paths), []
    for p in sorted(paths):
        stem = p.name.split(".")[0]
        head = stem.split("_")[0]
        if "_" in stem and head in names.get(p.parent, set()) and p.name != "__init__.py":
            found.append(f"{p}: {stem} beside the module {head}: make {head} a package with a module for "
                         f"what `{stem.removeprefix(head + '_')}` names")
    return found


def test_no_module_is_a_suffixed_sibling_of_another() -> None:
    found = suffix_sibling_problems([*SOURCES, *TEMPLATES.glob("*.j2")])
    assert not found, "\n".join(found)


def test_the_suffix_rule_names_the_modules_it_replaced() -> None:
    """The runtime before its model/ and transfer/ packages offends on each suffixed module; today's
    does not."""
    runtime = PACKAGE / "runtime"
    before = [runtime / "model.py", runtime / "model_checks.py", runtime / "model_table.py", runtime / "native.py",
              runtime / "native_transfer.py", runtime / "transfer.py", runtime / "pairs.py"]
    assert [f.split(":")[0] for f in suffix_sibling_problems(before)] == [
        str(runtime / "model_checks.py"), str(runtime / "model_table.py"), str(runtime / "native_transfer.py")]
    after = [runtime / "model" / "__init__.py", runtime / "model" / "checks.py", runtime / "model" / "table.py",
             runtime / "native.py", runtime / "transfer" / "__init__.py", runtime / "transfer" / "compiled.py"]
    assert suffix_sibling_problems(after) == []

# ----------------------------------------------------------------------------- code rules

#: Offenders in files another helper of this round is rewriting (issue 21): `module:qualname`
#: -> who owns it (`movers`: runtime/native*, kernels*, connector, devices, tiles and
#: plan/kernel*; the runtime's `rules: unfinished` entries went to `movers` too).
#: Temporary: the coordinator removes each entry once its owner's branch is in;
#: test_pending_entries_are_still_offenders fails on an entry that no longer offends.
PENDING_COMPLEXITY: dict[str, str] = {
}
PENDING_PARAMETERS: dict[str, str] = {
}
#: Functions whose imports close an import cycle (left out of the cycle graph) or are deferred
#: for no heavy dependency.
PENDING_IMPORTS: dict[str, str] = {
}
#: `module:ClassName` definitions left out of the one-name-per-class rule.
PENDING_CLASSES = {
}

#: Public APIs whose parameters mirror another system's signature, so they keep its arity.
_GPU_CONNECTOR = "LMCache's GPUConnectorInterface, with the keywords its connectors read from **kwargs"
ENGINE_SIGNATURES = {
    "kvgen.runtime.whole:ChunkConnector.from_gpu": _GPU_CONNECTOR,
    "kvgen.runtime.whole:ChunkConnector.to_gpu": _GPU_CONNECTOR,
    "kvgen.runtime.whole:ChunkConnector.batched_from_gpu": _GPU_CONNECTOR,
    "kvgen.runtime.whole:ChunkConnector.batched_to_gpu": _GPU_CONNECTOR,
    "kvgen.runtime.layerwise:LayerwiseConnector.batched_from_gpu": _GPU_CONNECTOR,
    "kvgen.runtime.layerwise:LayerwiseConnector.batched_to_gpu": _GPU_CONNECTOR,
    # LMCache's interface with a slot mapping per group and the request's state slot
    "kvgen.runtime.model.connector:ModelConnector.from_gpu": _GPU_CONNECTOR,
    "kvgen.runtime.model.connector:ModelConnector.to_gpu": _GPU_CONNECTOR,
    "kvgen.runtime.model.connector:ModelConnector.batched_from_gpu": _GPU_CONNECTOR,
    "kvgen.runtime.model.connector:ModelConnector.batched_to_gpu": _GPU_CONNECTOR,
    "kvgen.integrations.lmcache.trtllm:TRTLLMGPUConnector.__init__": "LMCache 0.5.6's TRTLLMGPUConnector.__init__",
}

#: What the generator's own stages need: deferring these dodges nothing heavy.
LIGHT = {"yaml", "jinja2", "jsonschema"}
MAX_COMPLEXITY = 15
MAX_PARAMETERS = 6


def _cycle_graph(left_out: Collection[str] = PENDING_IMPORTS.keys()) -> dict[str, list[ImportSite]]:
    """Each module's imports of kvgen modules, less those in the functions `left_out`."""
    graph: dict[str, list[ImportSite]] = {m: [] for m in MODULES}
    for site in sites():
        if site.target in MODULES and site.function not in left_out and not site.typing_only:
            graph[module_name(site.path)].append(site)
    return graph


def test_no_importcycles() -> None:
    """No module imports, directly or through others, a module that imports it back; an import
    inside a function is an import like any other here (one under `if TYPE_CHECKING:`, which
    never runs, is not)."""
    graph = _cycle_graph()
    found = []
    for part in cycles(graph):
        edges = [f"{module_name(s.path)} -> {s.target} ({s.where})" for m in part for s in graph[m] if s.target in part]
        found.append("cycle of " + ", ".join(part) + ": " + "; ".join(edges))
    assert not found, "\n".join(found)


def _deferral_problem(site: ImportSite) -> str | None:
    """Why an import inside a function is not a deferred heavy dependency, or None when it is."""
    if not site.commented:
        return "no comment saying why it is deferred"
    if not site.target.startswith("kvgen"):
        if site.target in LIGHT or site.target in sys.stdlib_module_names:
            return "standard library or a generator dependency: import it at the top"
        return None
    extra = third_party(loads_at_import(site.target)) - third_party(loads_at_import(module_name(site.path))) - LIGHT
    return None if extra else "loads nothing heavy this module does not load already: import it at the top"


def test_function_level_imports_only_defer_heavy_dependencies() -> None:
    """The rule for an import inside a function: it is allowed only when it defers an optional or
    heavy dependency, that is a package outside kvgen, the standard library and the generator's
    own dependencies (LIGHT: yaml, jinja2, jsonschema), such as torch in a torch-free path,
    triton, nixl, lmcache, vllm, sglang or matplotlib; or a kvgen module whose import loads such
    a package (transitively, through its module-level imports) that the importing module does
    not load at its own import. And a comment, on the import's line, on another line of its run
    of consecutive imports or on the line just above the run, says why it is deferred. An import
    whose only reason is a cycle (or start-up time) is none of these: it belongs at the top."""
    found = [f"{s.where}: import of {s.target} in {s.function}: {why}"
             for s in sites() if s.function is not None and s.function not in PENDING_IMPORTS
             and (why := _deferral_problem(s))]
    assert not found, "\n".join(found)


def test_no_function_above_complexity_15() -> None:
    found = [f"{f.where}: {f.key} has complexity {c} (at most {MAX_COMPLEXITY}): split it into named steps"
             for f in functions() if (c := complexity(f.node)) > MAX_COMPLEXITY and f.key not in PENDING_COMPLEXITY]
    assert not found, "\n".join(found)


def test_no_function_over_6_parameters() -> None:
    """Six at most (self and cls not counted; *args and **kwargs one each): arguments that travel
    together become one object. ENGINE_SIGNATURES lists the public APIs that mirror an engine's
    or LMCache's signature."""
    allowed = PENDING_PARAMETERS.keys() | ENGINE_SIGNATURES.keys()
    found = [f"{f.where}: {f.key} takes {n} parameters (at most {MAX_PARAMETERS})"
             for f in functions() if (n := parameters(f)) > MAX_PARAMETERS and f.key not in allowed]
    assert not found, "\n".join(found)


def test_no_two_classes_share_a_name() -> None:
    by_name: dict[str, list[str]] = {}
    for name, at in classes():
        key = f"{module_name(PACKAGE.parent / at.split(':')[0])}:{name}"
        if key not in PENDING_CLASSES:
            by_name.setdefault(name, []).append(at)
    found = [f"class {name} is defined {len(ats)} times: {', '.join(ats)}"
             for name, ats in by_name.items() if len(ats) > 1]
    assert not found, "\n".join(found)


def test_pending_entries_are_still_offenders() -> None:
    """Each exception names something that still needs it, so the lists only shrink."""
    by_key = {f.key: f for f in functions()}
    stale = [k for k in PENDING_COMPLEXITY if k not in by_key or complexity(by_key[k].node) <= MAX_COMPLEXITY]
    stale += [k for k in [*PENDING_PARAMETERS, *ENGINE_SIGNATURES]
              if k not in by_key or parameters(by_key[k]) <= MAX_PARAMETERS]
    closed = len(cycles(_cycle_graph()))
    stale += [k for k in PENDING_IMPORTS
              if not any(s.function == k and _deferral_problem(s) for s in sites())
              and len(cycles(_cycle_graph(PENDING_IMPORTS.keys() - {k}))) == closed]
    class_keys = {f"{module_name(PACKAGE.parent / at.split(':')[0])}:{n}" for n, at in classes()}
    stale += [k for k in PENDING_CLASSES if k not in class_keys]
    assert not stale, f"no longer offending (remove them): {stale}"
