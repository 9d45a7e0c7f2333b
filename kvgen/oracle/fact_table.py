"""The vocabulary of the fact tables (kvgen.oracle.facts and the per-source modules it merges):
the geometry a fact is evaluated at, one entry, and the table each source module fills.

Each source module (facts_host, facts_sglang, facts_vllm, and facts itself) fills a `FactTable`
of its own; kvgen.oracle.facts imports them and merges them into FACTS, so no module fills
another's table by being imported.
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


class FactTable(dict[str, Fact]):
    """The entries of one source module, by spec name."""

    def fact(self, name: str, kind: str, container: tuple[Level, ...],
             shape: Callable[[EngineGeometry], tuple[int, ...]], fixed: Mapping[str, int] = KV2,
             **flags: Any) -> Callable[[AddressFn], AddressFn]:
        """A decorator adding the entry whose address function it decorates; `flags` are Fact's
        mla, lmcache, code and single."""
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
