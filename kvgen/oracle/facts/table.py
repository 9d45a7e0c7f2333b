"""The vocabulary of every fact table: the geometry a fact is evaluated at, and the entries of
both kinds of cache the tables state.

- Caches and objects of one tensor tree (spec format 1): `Fact`, one element's `Address`, and the
  `FactTable` each source module fills (facts.host, facts.sglang, facts.vllm, and facts.layouts itself);
  kvgen.oracle.facts.layouts imports them and merges them into FACTS, so no module fills another's table
  by being imported.
- Caches of several parts or fields (spec format 2): `PartsFact` (its `PartFact`s and
  `PlaneFact`s) and where a plane's value lives, a `ByteAddress`; the tables of facts.planes and
  facts.quant hold them.

The tables import this module one way; nothing here reads a spec.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineGeometry:
    """One model and cache size, in the engines' words."""

    L: int  # num_layers
    B: int  # num_blocks (pages)
    N: int  # block_size: token slots per block
    H: int  # num_kv_heads (MLA caches have no head axis: one latent plane)
    C: int  # head_size; the latent width (kv_lora_rank + rope dim) for MLA
    T: int = 0  # tokens in one memory object (chunk)


#: (container path, tensor index) of one element.
Address = tuple[tuple[int, ...], tuple[int, ...]]
#: A container level, outermost first: (kind, axis). Kinds: "list", "tuple", or "seq" where the
#: sources disagree (LMCache types SGLang's pair as a list and documents it as a tuple).
Level = tuple[str, str]
#: address(g, l, kv, pos, h, c); pos is the slot for caches, the token for objects.
AddressFn = Callable[[EngineGeometry, int, int, int, int, int], Address]

KV2 = {"KV": 2}
PER_LAYER: tuple[Level, ...] = (("list", "L"),)
ONE_TENSOR: tuple[Level, ...] = ()


@dataclass(frozen=True)
class Fact:
    name: str  # the built-in spec this entry checks
    kind: str  # "paged" or "object"
    container: tuple[Level, ...]
    shape: Callable[[EngineGeometry], tuple[int, ...]]
    address: AddressFn
    #: Extents the source writes as literals; the spec's `sizes` must say exactly these.
    fixed: Mapping[str, int] = field(default_factory=dict)
    #: One latent plane: kv and h are always 0.
    mla: bool = False
    #: LMCache's engine format name (paged), or its MemoryFormat name and code (objects).
    lmcache: str | None = None
    code: int | None = None
    #: One plane with heads (LMCache's kv_size 1 with NH): kv is always 0.
    single: bool = False
    #: States per token (vLLM's Whisper block pooling): a token of manager slot s is stored in
    #: states s * pool .. s * pool + pool - 1, and `slot` in the address is a state.
    pool: int = 1


class FactTable(dict[str, Fact]):
    """The entries of one source module, by spec name."""

    def fact(self, name: str, kind: str, container: tuple[Level, ...],
             shape: Callable[[EngineGeometry], tuple[int, ...]], fixed: Mapping[str, int] = KV2,
             **flags: Any) -> Callable[[AddressFn], AddressFn]:
        """A decorator adding the entry whose address function it decorates; `flags` are Fact's
        mla, lmcache, code, single and pool."""
        def add(address: AddressFn) -> AddressFn:
            self[name] = Fact(name, kind, container, shape, address, dict(fixed), **flags)
            return address
        return add


def merge(*tables: FactTable) -> dict[str, Fact]:
    """One dict of every table's entries, in order; a spec named by two tables is a mistake in them."""
    merged: dict[str, Fact] = {}
    for table in tables:
        twice = merged.keys() & table.keys()
        if twice:
            raise ValueError(f"fact tables name {sorted(twice)} twice")
        merged.update(table)
    return merged


# -- caches of several parts or fields (spec format 2) ---------------------------------------------

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
    #: Extents the source requires to be whole tiles (SGLang's vectorized_5d: page_size and head_dim
    #: multiples of X), by tile size: a geometry counts these axes in tiles (kvgen.oracle.facts.planes
    #: source_geometry), so every geometry of the tests is one the source accepts.
    tiles: Mapping[str, int] = field(default_factory=dict)
    #: The extent the source's tensors give each split by a factor the spec names (`H%g`: SGLang's
    #: page_unified heads per group), at which the spec is compared.
    splits: Mapping[str, int] = field(default_factory=dict)

    def value_bytes(self, plane: PlaneFact) -> int:
        return BYTES[plane.dtype or self.parts[plane.part].dtype or FREE_DTYPE]
