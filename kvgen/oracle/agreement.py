"""Whether two address functions agree on every element of a product of ranges, worked out
on index grids at once, and the first element where they differ.

The fact tables (kvgen.oracle.facts.layouts, facts.planes) and kvgen.oracle.address are plain integer
arithmetic: given index grids that broadcast over the product of the ranges instead of
integers, they give every element's address in one evaluation. `agree_everywhere` says True
only when both give equal addresses for every element; anything else (a difference, a
function that cannot take grids) is False, and `first_difference` then walks the elements
one by one, in order, to name the first difference.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvgen.oracle.address import element_address
from kvgen.spec.model import Spec


def grids(sizes: Sequence[int]) -> list[torch.Tensor]:
    """One index grid per range: grid i holds 0 .. sizes[i] - 1 along dim i, broadcasting
    over the others (row-major over the product, as itertools.product walks it)."""
    out = []
    for i, n in enumerate(sizes):
        view = [1] * len(sizes)
        view[i] = n
        out.append(torch.arange(n).view(view))
    return out


def _same(a: Any, b: Any, shape: tuple[int, ...]) -> bool:
    if isinstance(a, tuple) or isinstance(b, tuple):
        return (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b)
                and all(_same(x, y, shape) for x, y in zip(a, b, strict=True)))
    x, y = torch.as_tensor(a), torch.as_tensor(b)
    if x.dtype.is_floating_point or y.dtype.is_floating_point:
        return False  # addresses are whole numbers; let the walk say what this is
    return bool(torch.equal(x.expand(shape), y.expand(shape)))


def agree_everywhere(sizes: Sequence[int], got: Callable[..., Any], want: Callable[..., Any]) -> bool:
    """True when got(*e) == want(*e) for every e in the product of range(n) for n in sizes."""
    shape = tuple(sizes)
    if 0 in shape:
        return True
    coords = grids(sizes)
    try:
        return _same(got(*coords), want(*coords), shape)
    except (TypeError, RuntimeError, ValueError, IndexError, KeyError):
        return False


def first_difference(sizes: Sequence[int], want: Callable[..., Any],
                     got: Callable[..., Any]) -> tuple[tuple[int, ...], Any, Any] | None:
    """(e, want(*e), got(*e)) of the first e, in product order, where the two differ, or None."""
    if agree_everywhere(sizes, want, got):
        return None
    for e in itertools.product(*(range(n) for n in sizes)):
        a, b = want(*e), got(*e)
        if a != b:
            return e, a, b
    return None


def address_disagreement(spec: Spec, ext: Any, want: Callable[..., Any], sizes: Sequence[int],
                         where: Any) -> str | None:
    """Where the spec's element_address first differs from `want(l, kv, pos, h, c)` (pos: the
    slot of a cache, the token of an object) over `sizes`, in words, or None."""
    pos = "slot" if spec.is_paged else "t"

    def got(*e: Any) -> Any:
        return element_address(spec, dict(zip(("l", "kv", pos, "h", "c"), e, strict=True)), ext)

    found = first_difference(sizes, want, got)
    if found is None:
        return None
    (layer, kv, p, h, c), wanted, at = found
    return f"(l={layer}, kv={kv}, {pos}={p}, h={h}, c={c}) at {at}, the source says {wanted} ({where})"
