"""A parsed spec file and how its problems are located: file, line, column, YAML path."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvgen.errors import Problem, YamlPath

#: Keys shown in a YAML path as they are; others (spaces, dots, control characters) are named
#: in the message instead, so a problem stays one `FILE:LINE:COL: PATH: message` line.
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")



@dataclass
class Document:
    """A parsed spec file: its data and where each value stands in the text."""

    file: str
    data: Any
    text: bytes
    positions: dict[YamlPath, tuple[int, int]] = field(default_factory=dict)
    key_positions: dict[YamlPath, tuple[int, int]] = field(default_factory=dict)

    def copied(self, file: str | None = None) -> Document:
        """A copy whose data and position tables may be edited without touching this one, read
        from `file` (default: this one's). The data is plain YAML data (mappings, lists, scalars)
        and every key and position a tuple, so only the mappings and lists are copied:
        copy.deepcopy took most of a memoized load."""
        return Document(self.file if file is None else file, _plain_copy(self.data), self.text,
                        dict(self.positions), dict(self.key_positions))

    def where(self, path: YamlPath, *, key: bool = False) -> tuple[int, int]:
        """Line and column of the value (or its key) at `path`, else of its nearest parent."""
        for cut in range(len(path), -1, -1):
            table = self.key_positions if key and cut == len(path) else self.positions
            if path[:cut] in table:
                return table[path[:cut]]
        return (1, 1)

    def problem(self, path: YamlPath, message: str, *, key: bool = False) -> Problem:
        line, col = self.where(path, key=key)
        shown, odd = shown_path(path)
        if odd is not None:
            message = f"under key {short(odd)}: {message}"
        return Problem(self.file, line, col, shown, message)


def _plain_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_copy(v) for v in value]
    return value  # a scalar: str, int, float, bool, None (YAML's plain types are immutable)


def short(value: Any, limit: int = 60) -> str:
    """repr() of a value, cut to `limit` characters so a message stays readable."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown_path(path: YamlPath) -> tuple[YamlPath, str | None]:
    """`path` cut before its first key that is not plain, and that key (None when all are)."""
    for i, part in enumerate(path):
        if isinstance(part, str) and not _PLAIN_KEY.fullmatch(part):
            return path[:i], part
    return path, None


def key_problem(doc: Document, path: YamlPath, key: str, message: str,
                 where: tuple[int, int] | None = None) -> Problem:
    """A problem at mapping key `key` under `path`, located at the key itself (or `where`).

    `message` names the key, so an odd key is left out of the path rather than repeated.
    """
    line, col = where or doc.where((*path, key), key=True)
    shown = shown_path((*path, key))[0]
    return Problem(doc.file, line, col, shown, message)


def one_line(text: str) -> str:
    return " ".join(text.split())
