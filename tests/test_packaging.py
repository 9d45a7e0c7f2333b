"""What a newcomer meets before any code runs: dependencies, install lines and docs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a wheel build and fresh interpreters

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text("utf-8")


def test_numpy_is_a_dependency_so_torch_imports_quietly() -> None:
    """numpy is declared; that torch then imports without NumPy's warning is checked in a fresh
    interpreter by the wheel's test below."""
    pyproject = (ROOT / "pyproject.toml").read_text("utf-8")
    deps = pyproject.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert re.search(r'"numpy[>=<~ 0-9.,]*"', deps), "numpy must be a runtime dependency"


def test_readme_gives_the_cpu_install_line_and_the_two_commands() -> None:
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in README
    assert "scripts/dev run" in README and "scripts/dev test" in README
    dev = (ROOT / "scripts" / "dev").read_text("utf-8")
    assert "run)" in dev and "test)" in dev


def test_docs_the_readme_links_exist() -> None:
    for link in re.findall(r"\]\(((?:docs|benchmarks)/[^)]+)\)", README):
        assert (ROOT / link).is_file(), f"README links to {link}, which does not exist"


def test_connector_docs_state_the_layerwise_protocol_and_the_slot_mapping() -> None:
    text = (ROOT / "docs" / "connectors.md").read_text("utf-8")
    for needed in ("next(", "send(", "L + 1", "L + 2", "slot_mapping", "thread"):
        assert needed in text, f"docs/connectors.md does not mention {needed!r}"


def _package_dirs() -> set[str]:
    """Every importable package of the source tree, dotted (kvgen and its subpackages)."""
    return {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kvgen").rglob("__init__.py")}


def test_every_source_package_is_listed_for_the_wheel() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text("utf-8")
    listed = set(re.findall(r'"(kvgen(?:\.[a-z_]+)*)"', pyproject.split("packages = [", 1)[1].split("]", 1)[0]))
    missing = sorted(_package_dirs() - listed)
    assert not missing, f"pyproject.toml's [tool.setuptools] packages leaves out {missing}: a wheel would lack them"


def test_the_wheel_carries_every_package_the_generated_code_needs(tmp_path: Path) -> None:
    """A real wheel of the project holds every package's modules, the C source the compiled path
    builds, the specs and the templates. Built as a user's pip builds it, in an isolated
    environment with the declared build backend."""
    source = tmp_path / "source"  # a copy without build/ and *.egg-info, which setuptools would reuse
    for name in ("kvgen", "specs", "templates", "generated"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                           "--wheel-dir", str(tmp_path), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    import zipfile

    (wheel,) = tmp_path.glob("kvgen-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in _package_dirs():
        assert f"{package.replace('.', '/')}/__init__.py" in names, f"the wheel lacks {package}"
    data = [f"kvgen/specs/{p.relative_to(ROOT / 'specs').as_posix()}" for p in (ROOT / "specs").rglob("*.yaml")]
    data += [f"kvgen/templates/{p.name}" for p in (ROOT / "templates").glob("*.j2")]
    data += [f"kvgen/generated/{p.name}" for p in (ROOT / "generated").glob("*.py")]
    data += ["kvgen/runtime/csrc/kvcopy.c", "kvgen/spec/schema/spec.schema.json"]
    missing = sorted(n for n in data if n not in names)
    assert not missing, f"the wheel lacks {len(missing)} data files, e.g. {missing[:5]}"
    _imports_from(wheel, tmp_path / "unpacked")


def _imports_from(wheel: Path, where: Path) -> None:
    """The unpacked wheel, first on sys.path, imports torch (quietly: numpy is there), the runtime,
    the remote planner and every generated connector, and `kvgen check` rebuilds from the specs
    and templates it ships exactly the connectors it ships: an installed kvgen works without the
    source tree. One fresh interpreter does both (the check as the command line runs it)."""
    import zipfile

    zipfile.ZipFile(wheel).extractall(where)
    env = {**os.environ, "PYTHONPATH": str(where)}
    script = ("import torch, kvgen, kvgen.generated, kvgen.remote, kvgen.runtime.movers, sys; "
              "assert kvgen.__file__.startswith(sys.argv[1]), kvgen.__file__; "
              "from kvgen.tools.cli import main; sys.exit(main(['check', '--out', sys.argv[2]]))")
    done = subprocess.run([sys.executable, "-c", script, str(where), str(where / "kvgen" / "generated")],
                          capture_output=True, text=True, timeout=300, cwd=where, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Failed to initialize NumPy" not in done.stderr, done.stderr
