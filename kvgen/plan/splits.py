"""Split (tiled) axes in copy plans (spec format 3: `C/8` with `C%8`, `N/8` with `N%8`).

A split axis is two dims of the copy, the tile (`C/8`, index c // 8) and the place in it
(`C%8`, index c % 8), each at its own stride in the cache. The object keeps the whole axis
dense, so its C (or H) is viewed as the same two dims, tile outer; its tokens T are viewed as
(B, N/8, N%8) for whole blocks, and a single token's slot offset n reaches the cache as
n // 8 and n % 8, one index per dim.

A tiled plane moves in words no wider than its element: its innermost dim need not be C
(AITER's V ends in N%8), so every value's bytes are a trailing axis `E` of their own, on both
sides, and C counts values.

String and tuple work on specs; torch is never imported.
"""

from __future__ import annotations

from kvgen.spec.elements import Factor, place_of, split_of, tiled
from kvgen.spec.model import Dim, Part

# A cache with split axes is always planned plane by plane (kvgen.spec.model.Spec.is_simple):
# the compiled kernel's planes programs and the Triton planes kernels read every extent from the
# plane's views (kvgen.plan.program.planes_program, kvgen.plan.kernel), a tile's and a place's too.
#: The trailing axis of a tiled plane: the words of one value (its bytes over the call's word).
ELEMENT = "E"


def is_tiled(part: Part) -> bool:
    return tiled(part.tensor_axes)


def splits(part: Part, base: str) -> tuple[str, ...]:
    """The tile then the place of `base` in the part (`("C/8", "C%8")`), or () where it is whole."""
    found = [a for a in part.tensor_axes if (split_of(a) or ("",))[0] == base]
    return tuple(sorted(found, key=lambda a: (split_of(a) or ("", "", 0))[1] != "/"))


def factor(axis: str) -> Factor:
    split = split_of(axis)
    if split is None:
        raise ValueError(f"{axis} is not a split axis")
    return split[2]


def factor_expr(axis: str, geometry: str = "g") -> str:
    """The factor of a split axis in the generated copy: a literal, or a named one's extent as
    read_geometry read it from the tensor into `geometry` (`g.split('H%g')`)."""
    base, _, f = split_of(axis) or ("", "", 0)
    return str(f) if isinstance(f, int) else f"{geometry}.split({place_of(base, f)!r})"


def object_dims(part: Part, dims: tuple[Dim, ...]) -> tuple[Dim, ...]:
    """An object's dims (T, H, C, ... as a plane's region or rows hold them) seen as a tiled
    part's: a split H or C as its tile and place fused in one dim (a view of the dense axis),
    and each value's words last."""
    out = []
    for d in dims:
        axes: list[str] = []
        for a in d.axes:
            axes.extend(splits(part, a) or (a,))
        if d.axes[-1:] == ("C",):
            axes.append(ELEMENT)
        out.append(Dim(tuple(axes)))
    return tuple(out)


def extents(part: Part, plane: int) -> dict[str, str]:
    """The extent expressions of a tiled plane's axes in the generated copy (`wd` the words of
    the call, `g` the geometry): C counts values, E a value's words, tiles and places theirs."""
    geo = f"g.planes[{plane}]"
    out = {"C": f"{geo}.values", ELEMENT: f"({geo}.C // {geo}.values // wd[{plane}])"}
    for base, whole in (("C", f"{geo}.values"), ("H", "g.H"), ("N", "g.N")):
        for a in splits(part, base):
            out[a] = f"({whole} // {factor_expr(a)})" if "/" in a else factor_expr(a)
    return out


def slot_index(cache_axes: tuple[str, ...]) -> dict[str, str]:
    """The index expression of each slot axis of a cache view for the token path: B by the
    chunk's block of each token, N by its offset, a split N by the offset's tile and place."""
    out = {"B": "ck.blk", "N": "ck.off"}
    for a in cache_axes:
        split = split_of(a)
        if split is not None and split[0] == "N":
            out[a] = f"(ck.off // {split[2]})" if split[1] == "/" else f"(ck.off % {split[2]})"
    return out


def slot_axes(cache_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The axes a token's slot (block, offset) addresses in a cache view: B and N, or B and N's tile and place."""
    n = tuple(a for a in cache_axes if (split_of(a) or ("",))[0] == "N")
    return ("B", *(n or ("N",)))


def slot_split(cache_axes: tuple[str, ...]) -> tuple[str, ...]:
    """(tile, place) of a block slot split into two cache dims (`N/8`, `N%8`); () where N is one dim
    or absent. Only a tile with its place: a slot's offset in its block splits by the place's extent."""
    found = {(split_of(a) or ("", ""))[1]: a for a in cache_axes if (split_of(a) or ("",))[0] == "N"}
    return (found["/"], found["%"]) if set(found) == {"/", "%"} else ()


def block_tokens(cache_axes: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
    """The axes T of the object splits into for whole blocks, and the sizes of that unflatten:
    (B, N) by (-1, g.N); for a split N (B, N/f, N%f) by (-1, g.N // f, f)."""
    split = slot_split(cache_axes)
    if not split:
        return ("B", "N"), "(-1, g.N)"
    tile, place = split
    return ("B", tile, place), f"(-1, g.N // {factor(tile)}, {factor(place)})"
