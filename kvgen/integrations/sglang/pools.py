"""A connector for an SGLang pool, from the pool itself: `kvgen.from_sglang(pool)`.

The pool states its layout (its class and `kv_cache_layout`), so nothing is read from the
shapes: the class and the word choose the spec, and detection and the generated geometry
reader then check that the buffers agree with it. Pools this module does not know (another
class, a quantized pool other than the FP4, MXFP8 and MiniMax M3 NVFP4 ones, a layout word without a
spec) are refused in SGLang's own terms. HiCache host pools state theirs in `layout`
(kvgen.integrations.sglang.host).
Written against SGLang 0.5.23 (sglang/srt/mem_cache/memory_pool.py); SGLang itself is never
imported here: the pool is read through its attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvgen import generated
from kvgen.errors import KVLayoutError
from kvgen.integrations.detect import detect, detectable
from kvgen.integrations.sglang.host import (
    GROUPED_LAYOUT,
    HOST_LAYOUTS,
    HOST_MLA_LAYOUTS,
    HOST_READERS,
    MINIMAX_CELL,
    MINIMAX_PAGE,
    minimax_cells,
)
from kvgen.integrations.sglang.layouts import FROM_POOL, NO_SPEC, TILED_SPECS

__all__ = ["PoolConnector", "from_sglang"]


@dataclass(frozen=True)
class PoolConnector:
    """A ready connector for one SGLang pool and the kvcaches tree to pass it.

    `layer_ids[i]` is the model layer of entry i of the tree's layer lists (a hybrid model's
    attention layers only). Pass `kvcaches` as `kvcaches=` on every store and load: its
    tensors are the pool's own buffers (views, no copy).
    """

    pool: str
    layout: str
    obj: str
    connector: Any
    kvcaches: Any
    layer_ids: tuple[int, ...]


#: The object each layout pairs with by default: LMCache's whole-chunk formats, or kvgen's
#: planes where K and V differ in width or the cache has typed fields.
DEFAULT_OBJECT = {"sglang_mha": "kv_2ltd", "sglang_mha_hnd": "kv_2ltd", "sglang_mha_v_head": "kv_planes",
                  "sglang_mla": "kv_mla", "vllm_dsa_indexer": "kv_planes", "sglang_mha_fp4": "kv_planes",
                  "sglang_mla_fp4": "kv_planes", "sglang_mha_mxfp8": "kv_planes",
                  "sglang_mha_mxfp8_interleaved": "kv_planes", "sglang_mha_vectorized_5d": "kv_planes",
                  "sglang_mha_vectorized_5d_fp8": "kv_planes",
                  "sglang_minimax_m3_nvfp4": "kv_planes", "sglang_minimax_m3_nvfp4_index": "kv_planes",
                  **dict.fromkeys(HOST_LAYOUTS, "kv_2ltd"), **dict.fromkeys(HOST_MLA_LAYOUTS, "kv_mla"),
                  GROUPED_LAYOUT: "kv_planes"}  # a tiled cache pairs with the objects that keep each plane dense


def _describe(pool: Any) -> str:
    """The pool's class and its layout word: kv_cache_layout (a device pool) or layout (a host pool)."""
    for attr in ("kv_cache_layout", "layout"):
        word = getattr(pool, attr, None)
        if word is not None:
            return f"{type(pool).__name__} with {attr} {word!r}"
    return type(pool).__name__


def _refuse(pool: Any, why: str) -> KVLayoutError:
    return KVLayoutError(f"kvgen has no connector for SGLang's {_describe(pool)}: {why}; kvgen reads "
                         "MHATokenToKVPool (kv_cache_layout 'nhd', 'hnd' or 'vectorized_5d'), MLATokenToKVPool, "
                         "DSATokenToKVPool, "
                         "MHATokenToKVPoolFP4 and MLATokenToKVPoolFP4 (head_dim 128, kv_cache_dim 576), "
                         "MHATokenToKVPoolMXFP8 (head_dim 128, any page_size; at 128 its scales in FA4's atoms), "
                         "MiniMaxM3Nvfp4KVPool and its MiniMaxM3Nvfp4MainKVPool and MiniMaxM3Nvfp4IndexKPool, and "
                         "HybridLinearKVPool's attention layers, and the HiCache host pools "
                         "MHATokenToKVPoolHost, MLATokenToKVPoolHost, MiniMaxM3Nvfp4MainKVPoolHost and "
                         "MiniMaxM3Nvfp4IndexKPoolHost")


def _layers(pool: Any, count: int) -> tuple[int, ...]:
    ids = getattr(pool, "model_layer_ids", None)
    if ids is not None and len(ids) == count:
        return tuple(int(i) for i in ids)
    start = int(getattr(pool, "start_layer", 0) or 0)
    return tuple(range(start, start + count))


def _layer_ids(pool: Any, inner: Any, part: str, count: int) -> tuple[int, ...]:
    """The model layer of each entry of the tree's layer lists: a hybrid model's attention layers,
    MiniMaxM3Nvfp4KVPool's index layers (index_k_layer_id_mapping) or its main pool's."""
    mapping = None
    if inner is not pool:
        mapping = pool.full_attention_layer_id_mapping
    elif type(pool).__name__ == "MiniMaxM3Nvfp4KVPool":
        if part != "indexer":
            return _layers(pool.main_pool, count)
        mapping = pool.index_k_layer_id_mapping
    if mapping is None:
        return _layers(pool, count)
    return tuple(sorted(mapping, key=mapping.get))


def _mha(pool: Any) -> tuple[str, Any, dict[str, Any]]:
    if getattr(pool, "k_scale_buffer", None) is not None or getattr(pool, "is_quantized_kv_cache", False):
        raise _refuse(pool, "its K and V carry scales (a quantized pool)")
    word = str(pool.kv_cache_layout).lower()
    if word in NO_SPEC:
        raise _refuse(pool, f"SGLang keeps {NO_SPEC[word]} there, which no kvgen spec describes")
    k, v = list(pool.k_buffer), list(pool.v_buffer)
    if not k or len(k) != len(v):
        raise _refuse(pool, f"it has {len(k)} K and {len(v)} V buffers")
    if word in FROM_POOL:
        return _vectorized_5d(pool, k, v), [k, v], {}
    same = tuple(k[0].shape) == tuple(v[0].shape)
    if word == "nhd" and k[0].dim() == 3:
        return ("sglang_mha" if same else "sglang_mha_v_head"), [k, v], {"kv_layout": "nhd"}
    if word == "hnd" and k[0].dim() == 4 and same:
        return "sglang_mha_hnd", [k, v], {"kv_layout": "hnd"}
    shapes = f"K {list(k[0].shape)}, V {list(v[0].shape)}"
    raise _refuse(pool, f"no kvgen spec holds its buffers ({shapes})")


def _vectorized_5d(pool: Any, k: list[Any], v: list[Any]) -> str:
    """kv_cache_layout 'vectorized_5d' (ROCm AITER's SHUFFLE tiles): K [blocks, H, C/x, page, x] and V
    [blocks, H, page/x, C, x] per layer, x = 16 // the storage itemsize (memory_pool.py
    _create_buffers_normal). The word and the storage dtype choose the spec; the buffers must be the
    5-D tiles of that x and of the pool's page_size, else the pool is refused before anything binds."""
    dtype = str(k[0].dtype).removeprefix("torch.")
    layout = TILED_SPECS.get(dtype)
    if layout is None:
        raise _refuse(pool, f"its buffers are {dtype}; kvgen's specs for it are for bfloat16 and float16 "
                            "(x 8) and fp8, which SGLang stores as uint8 (x 16)")
    x, page = 16 // k[0].element_size(), int(pool.page_size)
    for kb, vb in zip(k, v, strict=True):
        shapes = f"K {list(kb.shape)}, V {list(vb.shape)}"
        if kb.dim() != 5 or vb.dim() != 5 or not kb.dtype == vb.dtype == k[0].dtype:
            raise _refuse(pool, f"its buffers are not 5-D tiles of one dtype ({shapes})")
        blocks, heads = kb.shape[:2]
        if tuple(kb.shape[3:]) != (page, x) or tuple(vb.shape[:3]) != (blocks, heads, page // x) or vb.shape[4] != x:
            raise _refuse(pool, f"its buffers are not tiles of x {x} and page_size {page} ({shapes}): "
                                "K [blocks, H, C/x, page, x] and V [blocks, H, page/x, C, x]")
    return layout


def _mla(pool: Any) -> tuple[str, Any, dict[str, Any]]:
    if getattr(pool, "kv_scale_buffer", None) is not None or getattr(pool, "dsa_kv_cache_store_fp8", False):
        raise _refuse(pool, "its latent rows are packed fp8 with scales (dsa_kv_cache_store_fp8)")
    return "sglang_mla", list(pool.kv_buffer), {"use_mla": True}


def _dsa_indexer(pool: Any) -> tuple[str, Any, dict[str, Any]]:
    """DSA's index keys: per layer [pages, page_size * (128 + 4)] bytes, each page every token's
    128 fp8 values then every token's fp32 scale (index_key_cache.py `_buffer_shape`): the bytes
    of vllm_dsa_indexer's [blocks, block_size, 132] blocks, handed over as that (free) view."""
    if int(getattr(pool, "index_kpool", 1)) != 1 or any(getattr(pool, "skip_topk_layers", ())):
        raise _refuse(pool, "its index keys are pooled (index_kpool > 1) or skip layers (skip_topk_layers)")
    width = pool.index_head_dim + pool.index_head_dim // pool.quant_block_size * 4
    bufs = list(pool.index_k_with_scale_buffer)
    return "vllm_dsa_indexer", [b.view(b.shape[0], pool.page_size, width) for b in bufs], {}


def _fp4(pool: Any) -> tuple[str, Any, dict[str, Any]]:
    """MHATokenToKVPoolFP4 / MLATokenToKVPoolFP4: packed fp4 rows and UE8M0 scale rows per layer,
    handed over as the tuple of their lists (the specs are for head size 128 / latent width 576)."""
    mla = type(pool).__name__.startswith("MLA")
    width = int(pool.kv_cache_dim if mla else pool.head_dim)
    if width != (576 if mla else 128):
        raise _refuse(pool, f"kvgen's spec for it is for {'kv_cache_dim 576' if mla else 'head_dim 128'}, "
                            f"not {width}")
    names = ("kv_buffer", "kv_scale_buffer") if mla else ("k_buffer", "v_buffer", "k_scale_buffer", "v_scale_buffer")
    layout = "sglang_mla_fp4" if mla else "sglang_mha_fp4"
    return layout, [list(getattr(pool, n)) for n in names], {"pool": type(pool).__name__}


def _mxfp8(pool: Any) -> tuple[str, Any, dict[str, Any]]:
    """MHATokenToKVPoolMXFP8: fp8 K and V rows and UE8M0 scale rows (one per 32 values) per layer, the
    tuple of their lists. With page_size 128 SGLang interleaves the scales in FA4's atoms (token n of a
    page at [n % 32, n // 32] of its [32, 4] tile, a split slot axis): K and V [rows, H, C] are then
    handed over by page, [pages, 128, H, C], as sglang_mha_mxfp8_interleaved reads them."""
    dims = (int(pool.head_dim), int(pool.v_head_dim))
    if dims != (128, 128):
        raise _refuse(pool, f"kvgen's spec for it is for head_dim and v_head_dim 128, not {dims[0]} and {dims[1]}")
    names = ("k_buffer", "v_buffer", "k_scale_buffer", "v_scale_buffer")
    hints = {"pool": type(pool).__name__}
    if getattr(pool, "mxfp8_sf_interleaved", False):
        page = int(pool.page_size)
        rows = int(pool.k_buffer[0].shape[0]) if len(pool.k_buffer) else 0
        if rows % page:
            raise _refuse(pool, f"its K and V buffers hold {rows} rows, not whole pages of {page}")
        pages = [[b.view(-1, page, *b.shape[1:]) for b in getattr(pool, n)] for n in names[:2]]
        return "sglang_mha_mxfp8_interleaved", [*pages, *(list(getattr(pool, n)) for n in names[2:])], hints
    return "sglang_mha_mxfp8", [list(getattr(pool, n)) for n in names], hints


def _page_rows(pool: Any, heads: int, layout: str) -> tuple[str, Any, dict[str, Any]]:
    """MiniMax M3 NVFP4 pools keep one page row per (layer, page), pool.rows[layer] ([pages, row_bytes]):
    per K (and V) side every (head, token) cell's data, then every cell's scales, each region a multiple
    of 128 bytes, so no padding (_page_row_layout). Handed over as the rows' free view by cell."""
    sides = 2 if layout == "sglang_minimax_m3_nvfp4" else 1
    width = sides * heads * MINIMAX_PAGE * MINIMAX_CELL
    if int(pool.page_size) != MINIMAX_PAGE or int(pool.row_bytes) != width:
        raise _refuse(pool, f"kvgen's spec for it is for page_size {MINIMAX_PAGE} and rows of {width} bytes "
                            f"({heads} heads of head_dim 128), not page_size {pool.page_size} and {pool.row_bytes}")
    cells = minimax_cells(sides, heads)
    return layout, [r.view(r.shape[0], *cells) for r in pool.rows], {"pool": type(pool).__name__}


def _minimax_main(pool: Any) -> tuple[str, Any, dict[str, Any]]:
    """MiniMaxM3Nvfp4MainKVPool: a row is [K data | K scales | V data | V scales], every (head, token) cell."""
    if int(pool.head_dim) != 128:
        raise _refuse(pool, f"kvgen's spec for it is for head_dim 128, not {pool.head_dim}")
    return _page_rows(pool, int(pool.head_num), "sglang_minimax_m3_nvfp4")


def _minimax_index(pool: Any) -> tuple[str, Any, dict[str, Any]]:
    """MiniMaxM3Nvfp4IndexKPool: a row is every token's index K data, then every token's scales."""
    return _page_rows(pool, 1, "sglang_minimax_m3_nvfp4_index")


def _minimax_part(part: str) -> Callable[[Any], tuple[str, Any, dict[str, Any]]]:
    """MiniMaxM3Nvfp4KVPool: its main pool (`kv`) or its K-only index pool (`indexer`)."""
    def read(pool: Any) -> tuple[str, Any, dict[str, Any]]:
        inner = pool.main_pool if part == "kv" else pool.index_k_pool
        if inner is None:
            raise _refuse(pool, f"it has no {'main' if part == 'kv' else 'K-only index'} pool")
        return (_minimax_main if part == "kv" else _minimax_index)(inner)
    return read


#: SGLang 0.5.23 pool classes, by exact class name (a subclass may lay its buffers out otherwise:
#: MHATokenToKVPoolFP4 and MHATokenToKVPoolMXFP8 do), and how each hands its cache over.
READERS: dict[str, dict[str, Callable[[Any], tuple[str, Any, dict[str, Any]]]]] = {
    "MHATokenToKVPool": {"kv": _mha},
    "MLATokenToKVPool": {"kv": _mla},
    "DSATokenToKVPool": {"kv": _mla, "indexer": _dsa_indexer},
    "MHATokenToKVPoolFP4": {"kv": _fp4},
    "MLATokenToKVPoolFP4": {"kv": _fp4},
    "MHATokenToKVPoolMXFP8": {"kv": _mxfp8},
    "MiniMaxM3Nvfp4MainKVPool": {"kv": _minimax_main},
    "MiniMaxM3Nvfp4IndexKPool": {"indexer": _minimax_index},
    "MiniMaxM3Nvfp4KVPool": {"kv": _minimax_part("kv"), "indexer": _minimax_part("indexer")},
    **HOST_READERS,  # the HiCache host pools (kvgen.integrations.sglang.host)
}


def from_sglang(pool: Any, obj: str | None = None, *, part: str = "kv", **connector_args: Any) -> PoolConnector:
    """A connector bound to an SGLang pool's layout, and the kvcaches tree to pass it.

    `pool`: an SGLang MHATokenToKVPool (kv_cache_layout 'nhd' or 'hnd', a V head size other
    than K's giving the (K, V) planes spec; or 'vectorized_5d', ROCm AITER's SHUFFLE tiles, bf16,
    fp16 or fp8), MLATokenToKVPool, DSATokenToKVPool (`part='kv'` the
    latent rows, `part='indexer'` the index keys), HybridLinearKVPool (its full-attention
    layers; `layer_ids` says which model layers they are), the FP4 and MXFP8 pools, or
    MiniMaxM3Nvfp4KVPool (`part='kv'` its main pool's page rows, `part='indexer'` its K-only index
    pool's; either sub-pool may be passed itself), or a HiCache host pool: MHATokenToKVPoolHost and
    MLATokenToKVPoolHost (their one kv_buffer, by `layout`, to the hicache_* specs) and
    MiniMaxM3Nvfp4MainKVPoolHost / MiniMaxM3Nvfp4IndexKPoolHost (`part='indexer'`), per-layer views
    of their one kv_buffer bound to the device pools' specs (kvgen.integrations.sglang.host).
    `obj`: the object layout (default: the layout's usual one, DEFAULT_OBJECT). Other arguments go
    to the connector (device, use_gpu, backend, ...). KVLayoutError names the pool's class and
    kv_cache_layout (a host pool's layout) when kvgen has no spec for it.
    """
    inner = pool
    if type(pool).__name__ == "HybridLinearKVPool":
        inner = pool.full_kv_pool
    readers = READERS.get(type(inner).__name__)
    if readers is None:
        raise _refuse(inner, "kvgen has no spec for this pool class")
    if part not in readers:
        raise KVLayoutError(f"{type(inner).__name__} has no part {part!r}; parts: {', '.join(readers)}")
    layout, kvcaches, hints = readers[part](inner)
    if detectable(generated.LAYOUTS[layout]):
        found = detect(kvcaches, engine="sglang", **hints)  # the buffers agree with what the pool says
        if found.layout != layout:
            raise _refuse(inner, f"its buffers read as {found.layout}, not {layout}")
    obj = obj or DEFAULT_OBJECT[layout]
    cls = generated.get(layout, obj)
    per_part = ("sglang_mha", "sglang_mha_hnd", "sglang_mha_v_head", "sglang_mha_fp4", "sglang_mla_fp4",
                "sglang_mha_mxfp8", "sglang_mha_mxfp8_interleaved", "sglang_mha_vectorized_5d",
                "sglang_mha_vectorized_5d_fp8")
    count = len(kvcaches[0]) if layout in per_part else len(kvcaches)
    if layout in HOST_LAYOUTS | HOST_MLA_LAYOUTS:  # one tensor: its layers are the pool's (draft layers last)
        count = int(inner.layer_num)
    ids = _layer_ids(pool, inner, part, count)
    connector = cls(**connector_args)
    connector.bind(kvcaches)  # ready: get_shape and get_dtype answer before the first transfer
    return PoolConnector(type(pool).__name__, layout, obj, connector, kvcaches, ids)
