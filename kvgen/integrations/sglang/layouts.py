"""SGLang's own words for its pool layouts, and the rule that they decide.

An SGLang MHA pool states its layout in `pool.kv_cache_layout` (SGLang 0.5.23,
sglang/srt/mem_cache/memory_pool.py, and `KVBufferLayout` in device_pool_info.py): "nhd" keeps
[slots, H, C] rows, "hnd" (`SGLANG_USE_HND_KVCACHE=1`) keeps [pages, H, page_size, C] pages. A
4-D buffer of SGLang's reads as slots-before-heads and as heads-before-slots with every shape
(only the extents differ), so detection takes the pool's word, never the shape, and never a
head or page count, to choose between them: without `kv_layout=` such a buffer is refused and
the refusal names that hint. Words kvgen has no spec for are refused in SGLang's terms.

"vectorized_5d" (ROCm AITER's SHUFFLE layout) keeps K and V in tiles of different shapes, a cache of
two parts: detection, which reads one tree of tensors, refuses the word and names what binds it,
kvgen.from_sglang(pool), which takes the spec from the word and the storage dtype (TILED_SPECS). A
5-D buffer is never read as vectorized_5d without the word, nor as any other layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from kvgen.errors import KVLayoutError

__all__ = ["FROM_POOL", "NO_SPEC", "TILED_SPECS", "WORDS", "is_sglang", "needs_word", "neighbours", "pool_order",
           "read_word", "word_of"]

#: kv_cache_layout values kvgen has specs for, and the in-block order each names.
WORDS = {"nhd": "NHD", "paged_nhd": "NHD", "hnd": "HND"}
#: kv_cache_layout values of SGLang 0.5.23 whose specs have parts: bound from the pool, not detected.
FROM_POOL = {
    "vectorized_5d": "ROCm AITER's K [blocks, H, C/x, page, x] and V [blocks, H, page/x, C, x] tiles",
}
#: vectorized_5d's spec by the pool's storage dtype (x = 16 // its itemsize; fp8 is stored as uint8).
TILED_SPECS = {"bfloat16": "sglang_mha_vectorized_5d", "float16": "sglang_mha_vectorized_5d",
               "uint8": "sglang_mha_vectorized_5d_fp8"}
#: kv_cache_layout values of SGLang 0.5.23 with no kvgen spec, and what SGLang keeps under them.
NO_SPEC = {
    "page_major_layer_major": "PageMajorMHATokenToKVPool's page-major envelope (SGLang refuses to build it)",
}
#: Hints that count extents: they never choose between SGLang's 4-D readings.
COUNTS = ("num_layers", "num_blocks", "num_kv_heads", "block_size", "head_size", "hidden_dim")
#: What the hint is, in a refusal.
HINT = "kv_layout= the pool's kv_cache_layout ('nhd' or 'hnd')"


class _Facts(Protocol):
    name: str
    dims: tuple[tuple[str, ...], ...]
    quant: Mapping[str, str]

    def order(self) -> str | None: ...
    def families(self) -> set[str]: ...


def is_sglang(engine: Any) -> bool:
    return engine is not None and str(getattr(engine, "value", engine)).lower().startswith("sglang")


def read_word(hints: dict[str, Any]) -> None:
    """With engine='sglang', turn SGLang's kv_cache_layout word into the order it names (any
    case), or refuse a word kvgen has no spec for in SGLang's own terms."""
    word = hints.get("kv_layout")
    if word is None or not is_sglang(hints.get("engine")):
        return
    key = str(getattr(word, "value", word)).lower()
    if key in FROM_POOL:
        specs = ", ".join(sorted(set(TILED_SPECS.values())))
        raise KVLayoutError(f"SGLang's kv_cache_layout {key!r} ({FROM_POOL[key]}) is a cache of two parts, "
                            f"which detection does not read from tensors: kvgen.from_sglang(pool) binds it ({specs}), "
                            "or take the connector by name, kvgen.generated.get(layout, 'kv_planes')")
    if key in NO_SPEC:
        raise KVLayoutError(f"SGLang's kv_cache_layout {key!r} ({NO_SPEC[key]}) has no kvgen spec; kvgen "
                            f"reads SGLang's pools with kv_cache_layout {', '.join(map(repr, WORDS))}")
    if key in WORDS:
        hints["kv_layout"] = WORDS[key]


def pool_order(f: _Facts) -> str | None:
    """The order an SGLang pool's word names for spec `f`: its in-block order, or 'NHD' for a
    pool of [slots, H, C] rows (a folded slot axis before the heads), as SGLang calls it."""
    order = f.order()
    if order is not None or "sglang" not in f.families():
        return order
    n = next((i for i, d in enumerate(f.dims) if "N" in d), None)
    h = next((i for i, d in enumerate(f.dims) if d == ("H",)), None)
    return "NHD" if n is not None and h is not None and n < h else None


def word_of(f: _Facts) -> str | None:
    """The kv_cache_layout word of the pools `f` describes (4-D SGLang buffers only)."""
    if "sglang" not in f.families() or f.order() is None:
        return None
    return f.order().lower()  # type: ignore[union-attr]


def needs_word(f: _Facts, hints: Mapping[str, Any], named: bool) -> bool:
    """Whether `f` is a 4-D SGLang buffer read without the pool's word (nor a spec named, nor the pool
    class of a quantized spec: MiniMaxM3Nvfp4MainKVPool has one layout and no kv_cache_layout)."""
    said = hints.get("pool") is not None and f.quant.get("sglang") == hints["pool"]
    return not named and not said and hints.get("kv_layout") is None and word_of(f) is not None


def neighbours(fits: Sequence[tuple[Any, dict[str, int]]], facts: Sequence[Any], hints: Mapping[str, Any],
               named: bool, try_fit: Callable[[Any, Mapping[str, Any]], dict[str, int] | None]
               ) -> list[tuple[Any, dict[str, int]]]:
    """The other 4-D SGLang readings of a buffer one of `fits` reads without the pool's word,
    fitted (`try_fit(spec, hints)`: its extents, or None) with every hint but the counts: so
    the refusal lists both readings whatever heads and page size were stated."""
    if not any(needs_word(f, hints, named) for f, _ in fits):
        return []
    rest = {k: v for k, v in hints.items() if k not in COUNTS}
    taken = {f.name for f, _ in fits}
    out = []
    for g in facts:
        if g.name not in taken and word_of(g) is not None and (ext := try_fit(g, rest)) is not None:
            out.append((g, ext))
    return out
