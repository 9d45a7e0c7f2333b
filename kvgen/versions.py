"""Engine version ranges as specs state them (`versions: {vllm: ">=0.33,<0.34"}`).

A range is comma-separated clauses, each a comparison (==, !=, >=, <=, >, <) with a release
of up to three numbers; a version matches when every clause holds. Only release numbers
count (`0.33.0rc1+cu128` compares as 0.33.0): a spec describes a release line, not a build.
Torch-free, so the generator and detection share one reading.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable

__all__ = ["CLAUSE", "RANGE", "admits_some_release", "parse_range", "release", "some_release", "version_in"]

#: One clause of a range, as the spec schema admits it.
CLAUSE = r"(==|!=|>=|<=|>|<)\s*[0-9]+(\.[0-9]+){0,2}"
#: A whole range.
RANGE = rf"^{CLAUSE}(\s*,\s*{CLAUSE})*$"

_OPS: dict[str, Callable[[tuple[int, ...], tuple[int, ...]], bool]] = {
    "==": operator.eq, "!=": operator.ne, ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


def release(version: str) -> tuple[int, int, int]:
    """The release numbers of a version string, padded to three: '0.33' -> (0, 33, 0)."""
    match = re.match(r"^\s*v?([0-9]+(?:\.[0-9]+)*)", str(version))
    if match is None:
        raise ValueError(f"version {version!r}: expected numbers such as 0.33.0")
    numbers = tuple(int(n) for n in match.group(1).split("."))[:3]
    return numbers + (0,) * (3 - len(numbers))  # type: ignore[return-value]


def parse_range(text: str) -> tuple[tuple[str, tuple[int, int, int]], ...]:
    """A range's clauses as (operator, release) pairs; ValueError when it is not a range."""
    if not re.match(RANGE, text.strip()):
        raise ValueError(f"version range {text!r}: expected clauses such as '>=0.33,<0.34'")
    out = []
    for clause in text.split(","):
        clause = clause.strip()
        op = clause[:2] if clause[:2] in _OPS else clause[:1]
        out.append((op, release(clause[len(op):])))
    return tuple(out)


def version_in(version: str, text: str) -> bool:
    """Whether `version` lies in the range `text`."""
    return _holds(release(version), parse_range(text))


def _holds(have: tuple[int, ...], clauses: tuple[tuple[str, tuple[int, int, int]], ...]) -> bool:
    return all(_OPS[op](have, bound) for op, bound in clauses)


def admits_some_release(text: str) -> bool:
    """Whether any release lies in the range (">=0.34,<0.33" admits none). A range's
    edges are its bounds and the releases just past them, so testing those suffices."""
    clauses = parse_range(text)
    edges = {(0, 0, 0)} | {b for _, b in clauses} | {(b[0], b[1], b[2] + 1) for _, b in clauses}
    return any(_holds(edge, clauses) for edge in edges)


def some_release(text: str) -> str | None:
    """A release that lies in the range (the highest of its edges that does), as text; None for an
    empty range. What a message offers as the `engine_version` that selects a spec."""
    clauses = parse_range(text)
    edges = {(0, 0, 0)} | {b for _, b in clauses} | {(b[0], b[1], b[2] + 1) for _, b in clauses}
    edges |= {(b[0], b[1] - 1, 0) for _, b in clauses if b[1] > 0}
    held = [edge for edge in edges if _holds(edge, clauses)]
    return ".".join(map(str, max(held))) if held else None
