"""kvgen's errors: one base type, one subtype per stage a user can get wrong.

KVGenError
  SpecError      a spec file is wrong (every problem, each with FILE:LINE:COL and YAML path)
  BuildError     a build could not complete (the previous output is left as it was)
  KVLayoutError  a cache, memory object, slot mapping or name does not fit, at run time

Every public entry point raises only these for bad input; TypeError stays for calls with
the wrong signature. No torch here: the runtime and the generator both import this.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

YamlPath = tuple[str | int, ...]


def format_path(path: YamlPath) -> str:
    """`('dims', 2, 0)` -> `dims[2][0]`; the document root is `<root>`."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "<root>"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec, at a place in its YAML."""

    file: str
    line: int
    col: int
    path: YamlPath
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}: {format_path(self.path)}: {self.message}"


class KVGenError(Exception):
    """Base of every error kvgen raises for bad input."""


class SpecError(KVGenError, ValueError):
    """One or more problems in one or more spec files.

    Raised with every problem found, not only the first, so a user fixes a file in one go.
    """

    def __init__(self, problems: Iterable[Problem]):
        self.problems: tuple[Problem, ...] = tuple(problems)
        if not self.problems:
            raise ValueError("SpecError needs at least one problem")
        super().__init__("\n".join(str(p) for p in self.problems))


class BuildError(KVGenError, RuntimeError):
    """A build that could not complete; the previous output is left as it was."""


class KVLayoutError(KVGenError, ValueError):
    """A cache, memory object, slot mapping, name or device that does not match what a
    connector was generated for; raised before anything is written."""


def display_path(path: Path) -> str:
    """A path as a user would type it: relative to the working directory when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, RuntimeError, OSError):  # elsewhere; or a symlink loop, which cannot be resolved
        return str(path)
