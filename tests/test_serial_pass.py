"""The serial pass of scripts/dev test (`pytest -m serial`) imports only the modules that mark a
test serial (tests/conftest.py): a module without the marker is never imported there, and every
other pass collects it as before."""

from __future__ import annotations

import shutil
import subprocess
import sys
import types
from pathlib import Path

import conftest
import pytest

HERE = Path(__file__).resolve().parent

SERIAL = "import pytest\n\n\n@pytest.mark.serial\ndef test_timed():\n    pass\n\n\ndef test_plain():\n    pass\n"
#: Importing this module fails: a pass that imports it reports a collection error.
UNMARKED = "raise RuntimeError('imported')\n\n\ndef test_other():\n    pass\n"


def _collect(tmp_path: Path, marks: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                           "-m", marks, str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_the_serial_pass_imports_only_modules_that_mark_a_test_serial(tmp_path: Path) -> None:
    for name in ("conftest.py", "hang_watch.py"):  # the conftest and the plugin it loads
        shutil.copy(HERE / name, tmp_path / name)
    (tmp_path / "test_marked.py").write_text(SERIAL)
    (tmp_path / "test_unmarked.py").write_text(UNMARKED)
    serial = _collect(tmp_path, "serial")
    assert serial.returncode == 0, serial.stdout + serial.stderr
    assert "test_marked.py::test_timed" in serial.stdout and "test_unmarked" not in serial.stdout


@pytest.mark.parametrize("marks", ["not serial", "", "serial or slow"])
def test_every_other_pass_leaves_collection_to_pytest(tmp_path: Path, marks: str) -> None:
    """The hook the serial pass ignores modules by says nothing under any other -m (None: pytest's
    own rules decide), so those passes import every module (and show its import errors)."""
    (tmp_path / "test_unmarked.py").write_text(UNMARKED)
    assert conftest.pytest_ignore_collect(tmp_path / "test_unmarked.py", _config(marks)) is None
    assert conftest.pytest_ignore_collect(tmp_path / "test_unmarked.py", _config("serial")) is True


def _config(marks: str) -> types.SimpleNamespace:
    """What the hook reads of pytest's config: the -m expression."""
    return types.SimpleNamespace(getoption=lambda name, default=None: marks if name == "markexpr" else default)
