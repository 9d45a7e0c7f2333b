"""The arrow notation for layouts, printed and parsed in one place.

`L -> [KV B N H C]` reads: a Python list over layers, each holding one tensor with dims
KV, B, N, H, C (outermost first). `(H C)` is a fused dim (H outermost), `1` a singleton,
and `H=8` an axis with its extent. The spec model and the runtime's error messages both
print through here; `parse` reads the same text back (`kvgen explain`, docs, tests).

No torch here: the generator and the runtime both import this module.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from kvgen.errors import KVGenError

#: One tensor dim: () singleton, (axis,) one axis, (outer, ..., inner) fused.
Dim = tuple[str, ...]
Extents = Mapping[str, int]

_AXIS = re.compile(r"[A-Z]+")
_ITEM = re.compile(r"(\([^()]*\)|[^\s()]+)")


class NotationError(KVGenError, ValueError):
    """Text that is not a layout in arrow notation."""


def _axis(axis: str, extents: Extents | None) -> str:
    return f"{axis}={extents[axis]}" if extents and axis in extents else axis


def format_dim(dim: Dim, extents: Extents | None = None) -> str:
    if not dim:
        return "1"
    inner = " ".join(_axis(a, extents) for a in dim)
    return f"({inner})" if len(dim) > 1 else inner


def format_layout(lists: Sequence[str], dims: Sequence[Dim], extents: Extents | None = None) -> str:
    """`L -> [KV B N H C]`; with extents, `L=32 -> [KV=2 B N H C]` for the axes given."""
    leaf = "[" + " ".join(format_dim(d, extents) for d in dims) + "]"
    return " -> ".join([*(_axis(a, extents) for a in lists), leaf])


def _parse_axis(text: str, where: str) -> tuple[str, int | None]:
    name, eq, value = text.partition("=")
    if not _AXIS.fullmatch(name) or (eq and not value.isdigit()):
        raise NotationError(f"{where}: {text!r} is not an axis (capital letters, optionally =extent)")
    return name, int(value) if eq else None


def parse_layout(text: str) -> tuple[tuple[str, ...], tuple[Dim, ...], dict[str, int]]:
    """(lists, dims, extents) of an arrow-notation layout; the inverse of format_layout."""
    *levels, leaf = [part.strip() for part in text.split("->")]
    if not (leaf.startswith("[") and leaf.endswith("]")):
        raise NotationError(f"{text!r}: the last part must be the tensor's dims in [...]")
    extents: dict[str, int] = {}

    def axis(item: str, where: str) -> str:
        name, value = _parse_axis(item, where)
        if value is not None:
            extents[name] = value
        return name

    lists = tuple(axis(level, "list level") for level in levels)
    dims: list[Dim] = []
    body = leaf[1:-1]
    items = _ITEM.findall(body)
    if "".join(items).replace(" ", "") != "".join(body.split()):
        raise NotationError(f"{text!r}: unbalanced parentheses in the dims")
    for item in items:
        if item == "1":
            dims.append(())
        elif item.startswith("("):
            parts = item[1:-1].split()
            if len(parts) < 2:
                raise NotationError(f"{text!r}: a fused dim {item} needs at least two axes")
            dims.append(tuple(axis(p, "fused dim") for p in parts))
        else:
            dims.append((axis(item, "dim"),))
    if not dims:
        raise NotationError(f"{text!r}: a tensor needs at least one dim")
    return lists, tuple(dims), extents
