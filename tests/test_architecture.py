"""The pipeline's shape: stages import one way, the generator never imports torch, and
the runtime never imports a generator stage; no hand-written module grows past ~400 lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvgen"

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


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at top level or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


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


def test_building_the_library_never_imports_torch() -> None:
    code = ("import sys, tempfile, pathlib\n"
            "from kvgen.emit.build import render\n"
            "from kvgen.tools.cli import main\n"
            "render()\n"
            "out = pathlib.Path(tempfile.mkdtemp()) / 'g'\n"
            "assert main(['build', '--out', str(out)]) == 0\n"
            "assert main(['explain', 'NHD']) == 0\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'kvgen.runtime')))\n"
            "assert not loaded, loaded\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=PACKAGE.parent, timeout=120)
    assert done.returncode == 0, done.stderr


def test_generated_and_runtime_code_import_no_generator_stage() -> None:
    generated = PACKAGE.parent / "generated"
    for path in [*sorted(generated.glob("*.py")), *sorted((PACKAGE / "runtime").glob("*.py"))]:
        stages = {stage_of(n) for n in imports(path) if n.startswith("kvgen")}
        assert stages <= {"runtime", "core"}, f"{path.name} imports {sorted(stages)}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_hand_written_module_over_400_lines(path: Path) -> None:
    lines = len(path.read_text("utf-8").splitlines())
    assert lines <= 420, f"{path.relative_to(PACKAGE)} has {lines} lines; split it by job"


def test_closed_vocabularies_are_enums() -> None:
    from kvgen.plan.convert import Conversion, Direction, plan_converters
    from kvgen.plan.copy import CopyPath, Mode, plan_library
    from kvgen.spec.library import load_library
    from kvgen.spec.model import Kind, Vocabulary

    library = load_library()
    plans = plan_library(library)
    assert all(isinstance(s.kind, Kind) for s in library.specs)
    assert {p.mode for p in plans} == set(Mode) and {p.path for p in plans} == set(CopyPath)
    converters = plan_converters(library)
    assert {c.kind for c in converters} <= set(Conversion) and {c.direction for c in converters} <= set(Direction)
    assert all(issubclass(e, Vocabulary) for e in (Kind, Mode, CopyPath, Conversion, Direction))
    assert str(Mode.WHOLE) == "whole" == Mode.WHOLE  # prints and compares as its word
