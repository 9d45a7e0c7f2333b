"""Where one KV element lives: the plain arithmetic of a spec, element by element.

This is the definition the generated copies are checked against (through
kvgen.oracle.reference); it shares nothing with the planner. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvgen.spec.model import Spec

#: Logical coordinates of an element: l, kv, h, c, and slot (paged) or t (object).
Coords = Mapping[str, int]


def _coordinate(axis: str, coords: Coords, ext: Mapping[str, int]) -> int:
    if axis == "B":
        return coords["slot"] // ext["N"]
    if axis == "N":
        return coords["slot"] % ext["N"]
    if axis == "T":
        return coords["t"]
    return coords.get(axis.lower(), 0)


def element_address(spec: Spec, coords: Coords, ext: Mapping[str, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(container path, tensor index) of the element at `coords` for extents `ext`."""
    path = tuple(_coordinate(a, coords, ext) for a in spec.lists)
    index = []
    for dim in spec.dims:
        if dim.is_singleton:
            index.append(0)
        elif dim.is_slot:
            index.append(coords["slot"])
        else:
            flat = 0
            for axis in dim.axes:
                flat = flat * ext[axis] + _coordinate(axis, coords, ext)
            index.append(flat)
    return path, tuple(index)


_SYMBOL = {"L": "l", "KV": "kv", "H": "h", "C": "c", "T": "t", "B": "slot // N", "N": "slot % N"}


def symbolic_address(spec: Spec) -> str:
    """`kvcaches[l][kv, slot // N, slot % N, h, c]` for people (kvgen explain)."""
    root = "kvcaches" if spec.is_paged else "tensor"
    path = "".join(f"[{_SYMBOL[a]}]" for a in spec.lists)
    parts = []
    for dim in spec.dims:
        if dim.is_singleton:
            parts.append("0")
        elif dim.is_slot:
            parts.append("slot")
        elif dim.is_fused:
            text = _SYMBOL[dim.axes[0]]
            for i, axis in enumerate(dim.axes[1:]):
                text = f"{text if i == 0 else f'({text})'} * {axis} + {_SYMBOL[axis]}"
            parts.append(text)
        else:
            parts.append(_SYMBOL[dim.axes[0]])
    return f"{root}{path}[{', '.join(parts)}]"
