"""The README's walkthroughs run one after another in one folder, as a new user types them:
each shell block, then the Python block that follows it (issue 20, item 21)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # eight processes, one after another

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("## Adding a layout", "## A cache with scales", "## A quantized cache", "## A hybrid model")


def _blocks(section: str) -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    body = text.split(section, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(sh|python)\n(.*?)```", body, flags=re.S)


def test_the_walkthroughs_run_in_sequence_in_one_folder(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "kvgen"  # the `kvgen` a user's shell finds: this checkout's
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m kvgen \"$@\"\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(work)}
    ran = []
    for section in SECTIONS:
        blocks = _blocks(section)
        assert blocks, section
        for kind, code in blocks:
            command = ["bash", "-euo", "pipefail", "-c", code] if kind == "sh" else [sys.executable, "-c", code]
            done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"{section}, {kind} block:\n{code}\n{done.stdout}\n{done.stderr}"
            assert "warning:" not in done.stderr, f"{section}: {done.stderr}"  # e.g. a copy of a built-in
            ran.append((section, kind))
    assert [k for _, k in ran].count("sh") == 4 and [k for _, k in ran].count("python") == 4
