"""What a newcomer meets before any code runs: dependencies, install lines and docs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text("utf-8")


def test_numpy_is_a_dependency_so_torch_imports_quietly() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text("utf-8")
    deps = pyproject.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert re.search(r'"numpy[>=<~ 0-9.,]*"', deps), "numpy must be a runtime dependency"
    done = subprocess.run([sys.executable, "-c", "import torch, kvgen.runtime"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "Failed to initialize NumPy" not in done.stderr, done.stderr


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


def test_every_package_of_kvgen_ships_in_the_wheel() -> None:
    """[tool.setuptools] lists packages by name (no discovery): each folder of kvgen/ with an
    __init__.py is one of them, so an installed kvgen imports what a checkout imports."""
    pyproject = (ROOT / "pyproject.toml").read_text("utf-8")
    listed = set(re.findall(r'"(kvgen(?:\.\w+)*)"', pyproject.split("packages = [", 1)[1].split("]", 1)[0]))
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kvgen").rglob("__init__.py")}
    assert not found - listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
