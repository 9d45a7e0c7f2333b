"""`kvgen build` and `kvgen check`: render a library and write it in one step, or compare.

A build renders everything in memory, writes it into a temporary folder beside the
output and then swaps the folders, so an interrupted or failed build leaves the previous
output whole and importable.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvgen.emit.render import body_digest, render_package, unseal
from kvgen.errors import BuildError
from kvgen.plan.package import plan_package
from kvgen.spec.library import data_dir, load_library

DEFAULT_OUT = data_dir("generated")
_IGNORED = {"__pycache__"}


def render(extra_specs: Sequence[Path] = (), *, builtin: bool = True) -> dict[str, str]:
    library = load_library(extra_specs, builtin=builtin)
    return render_package(plan_package(library))


def write_atomically(out: Path, files: dict[str, str]) -> None:
    """Replace folder `out` with exactly `files`; on any failure the old folder stays."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.new-", dir=out.parent))
    backup = out.parent / f".{out.name}.old-{os.getpid()}"
    try:
        for name, text in files.items():
            (staging / name).write_text(text, encoding="utf-8")
        if out.exists():
            os.rename(out, backup)
        try:
            os.rename(staging, out)
        except OSError:
            if backup.exists():
                os.rename(backup, out)
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(backup, ignore_errors=True)


def build(out: Path = DEFAULT_OUT, extra_specs: Sequence[Path] = (), *, builtin: bool = True) -> dict[str, str]:
    files = render(extra_specs, builtin=builtin)
    write_atomically(out, files)
    return files


@dataclass
class CheckReport:
    stale: list[str] = field(default_factory=list)
    edited: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    stray: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.stale or self.edited or self.missing or self.stray)

    def lines(self) -> list[str]:
        out = [f"edited by hand: {n}" for n in self.edited]
        out += [f"out of date (specs or templates changed): {n}" for n in self.stale]
        out += [f"missing: {n}" for n in self.missing]
        out += [f"stray file, not written by kvgen build: {n}" for n in self.stray]
        return out


def check(out: Path = DEFAULT_OUT, extra_specs: Sequence[Path] = (), *, builtin: bool = True) -> CheckReport:
    """Compare `out` with what `build` would write there."""
    expected = render(extra_specs, builtin=builtin)
    report = CheckReport()
    if not out.is_dir():
        report.missing = sorted(expected)
        return report
    present = {p.name for p in out.iterdir() if p.name not in _IGNORED}
    report.missing = sorted(set(expected) - present)
    report.stray = sorted(present - set(expected))
    for name in sorted(set(expected) & present):
        path = out / name
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise BuildError(f"cannot read {path}: {exc}") from None
        if text == expected[name]:
            continue
        recorded, body = unseal(text)
        (report.stale if recorded == body_digest(body) else report.edited).append(name)
    return report
