"""Element types of specs: the dtypes a tensor may be stored as, and (format 3) the sub-byte
and scale types a field may hold, with how two sub-byte values share a byte. No torch here."""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Iterable, Mapping

DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")
#: Bytes per element of each dtype.
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
            "float8_e8m0fnu": 1}
#: Format 3: storage dtypes a spec must name in its `dtypes` (they are not among a spec's default
#: DTYPES): float8_e8m0fnu, torch's UE8M0 scale type (SGLang's MXFP8 scale tensors), has no
#: arithmetic and no index kernels on CPU, so no cache is assumed to be one unless its spec says so.
EXPLICIT_DTYPES = ("float8_e8m0fnu",)
#: Format 3: element types only a field may have (a tensor is stored as one of DTYPES). The
#: sub-byte types hold two values per byte, in the field's `packing` order; ue8m0 is a power-of-two
#: scale (an fp8 exponent), one byte.
#: uint3 is a bit stream: value c is bits [3c, 3c + 3) of the field's bytes read as one little-endian
#: integer, eight values in three bytes (vLLM's TurboQuant 3-bit codes); it packs `low_first` only.
SUB_BYTE = ("fp4_e2m1", "int4", "uint4", "uint3")
BIT_STREAMS = ("uint3",)
FIELD_DTYPES = (*DTYPES, *SUB_BYTE, "ue8m0")
#: Bits per value of every field dtype.
BITS = {**{t: 8 * n for t, n in ITEMSIZE.items() if t in DTYPES}, **dict.fromkeys(SUB_BYTE, 4), "uint3": 3,
        "ue8m0": 8}
#: The element types a scale field may have.
SCALE_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "ue8m0")

__all__ = ["BITS", "BIT_STREAMS", "DTYPES", "EXPLICIT_DTYPES", "FIELD_DTYPES", "ITEMSIZE", "SCALE_DTYPES", "SUB_BYTE",
           "Factor", "Packing", "factor_value", "place_of", "split_extents", "split_of", "tiled"]

#: Format 3 split (tiled) axes: `C/16` is the index c // 16 and `C%16` the index c % 16 of an
#: axis split into (C / 16, 16) tiles; N (the slot in a block) and H split alike. A factor may be
#: a name instead (`H/g` with `H%g`): it is then read from the tensor, as the place's extent
#: (SGLang's page_unified head groups: g heads in each of H / g groups).
SPLIT = re.compile(r"^(N|H|C)([/%])([1-9][0-9]{0,3}|[a-z][a-z0-9]{0,7})$")

#: A split's factor: a literal, or the name of one read from the tensor.
Factor = int | str


@functools.lru_cache(maxsize=4096)  # few axis names, asked millions of times (planner, oracle)
def split_of(axis: str) -> tuple[str, str, Factor] | None:
    """(base axis, "/" or "%", factor) of a split axis name, or None for a plain axis; a named
    factor is its name."""
    m = SPLIT.match(axis)
    if m is None:
        return None
    f = m.group(3)
    return m.group(1), m.group(2), int(f) if f.isdigit() else f


def place_of(base: str, factor: Factor) -> str:
    """The place axis of a split (`H%g`): its extent is the factor, literal or read from the tensor."""
    return f"{base}%{factor}"


def factor_value(base: str, factor: Factor, ext: Mapping[str, int]) -> int:
    """The factor of a split at extents `ext`: a literal as it is, a named one the place's extent there."""
    return factor if isinstance(factor, int) else ext[place_of(base, factor)]


class Packing(str, enum.Enum):
    """Which value of a byte of a sub-byte field comes first: value 2j in the low nibble and
    2j + 1 in the high one (`low_first`, vLLM's pack_int4_nibbles), or the other way round."""

    LOW_FIRST = "low_first"
    HIGH_FIRST = "high_first"

    def __str__(self) -> str:
        return str(self.value)


def tiled(axes: Iterable[str]) -> bool:
    """Whether any of these axis names is a split (format 3 tiles)."""
    return any(split_of(a) is not None for a in axes)


def split_extents(axes: Iterable[str], ext: Mapping[str, int]) -> dict[str, int]:
    """The extent of each split axis among `axes`: C/16 has C // 16, C%16 has 16; a named factor's
    place (`H%g`) keeps the extent `ext` gives it, and its tile has H // that."""
    out = {}
    for a in axes:
        split = split_of(a)
        if split is not None:
            base, op, f = split
            value = factor_value(base, f, ext)
            out[a] = ext[base] // value if op == "/" else value
    return out
