"""The vocabulary of the caches-of-several-parts facts (oracle/facts_parts, oracle/facts_quant):
a part, a plane and a whole cache as an engine's sources state them, and where a plane's value
lives. Shared by both tables, which each import it one way."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvgen.oracle.fact_table import EngineGeometry, Level

#: (container path, index of the storage element holding the value's first byte, byte in it).
ByteAddress = tuple[tuple[int, ...], tuple[int, ...], int]
#: where(g, layer, kv, pos, h, c); pos is the slot for caches, the token for objects.
PlaneAddress = Callable[[EngineGeometry, int, int, int, int, int], ByteAddress]

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1, "int8": 1,
         "float8_e8m0fnu": 1, "int4": 1, "uint4": 1, "fp4_e2m1": 1,
         "uint3": 1, "ue8m0": 1}  # sub-byte values move as their packed bytes
#: The dtype a test gives a part whose source leaves its dtype open.
FREE_DTYPE = "bfloat16"


def width(g: EngineGeometry, part: int) -> int:
    """The C of a part whose width the source leaves open (latent, rope, K, V head sizes):
    different per part, so a swapped pair of parts changes a shape."""
    return g.C + 3 * part


@dataclass(frozen=True)
class PartFact:
    name: str
    shape: Callable[[EngineGeometry], tuple[int, ...]]
    #: The dtypes the source allows the part's tensors (empty: any); tests use the first.
    dtypes: tuple[str, ...]

    @property
    def dtype(self) -> str | None:
        return self.dtypes[0] if self.dtypes else None

    def item(self) -> int:
        return BYTES[self.dtype or FREE_DTYPE]


@dataclass(frozen=True)
class PlaneFact:
    name: str
    part: int
    #: The dtype of one value: a field's, else the part's (None when any).
    dtype: str | None
    count: Callable[[EngineGeometry], int]
    kv: bool
    heads: bool
    slots: bool
    address: PlaneAddress


@dataclass(frozen=True)
class PartsFact:
    name: str
    container: tuple[Level, ...]
    parts: tuple[PartFact, ...]
    planes: tuple[PlaneFact, ...]
    fixed: Mapping[str, int] = field(default_factory=dict)
    lmcache: str | None = None

    def value_bytes(self, plane: PlaneFact) -> int:
        return BYTES[plane.dtype or self.parts[plane.part].dtype or FREE_DTYPE]
