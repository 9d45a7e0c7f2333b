"""SGLang's HiCache host pools, read for `kvgen.from_sglang(pool)`: which spec each binds, and the tree.

A host pool states its layout in `pool.layout` (SGLang 0.5.23, sglang/srt/mem_cache/pool_host/mha.py,
mla.py and minimax_m3_nvfp4.py, each `init_kv_buffer`). MHATokenToKVPoolHost and MLATokenToKVPoolHost
keep one tensor, `kv_buffer`, whose dims the layout word names: the tree is that tensor, bound to the
built-in specs specs/host/hicache_*.yaml. The MiniMax M3 NVFP4 host mirrors keep one uint8 tensor of
device page rows, [L, pages, row_bytes] (layer_first) or [pages, L, 1, row_bytes] (page_first and
page_first_direct, the same bytes); the tree is its per-layer [pages, row_bytes] views, viewed by
cell as the device pool's rows are, bound to the device specs. Host specs are never detected from
tensors, so the tree's shapes are checked here against what the pool's fields say, and a layout or
a shape kvgen has no spec for is refused, in SGLang's terms, before anything binds.
SGLang itself is never imported here: the pool is read through its attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvgen.errors import KVLayoutError

__all__ = ["GROUPED_LAYOUT", "HOST_LAYOUTS", "HOST_MLA_LAYOUTS", "HOST_READERS", "MINIMAX_CELL", "MINIMAX_PAGE",
           "minimax_cells"]

#: A reader's answer: the spec, the kvcaches tree, detection's hints.
Read = tuple[str, Any, dict[str, Any]]

#: MiniMax M3 NVFP4's page rows: 128 tokens a page, each token and head 64 fp4 data bytes and 8 scale bytes.
MINIMAX_PAGE, MINIMAX_CELL = 128, 64 + 8

#: MHATokenToKVPoolHost.init_kv_buffer's dims, by layout word, from the pool's fields.
MHA_DIMS: dict[str, Callable[[Any], tuple[int, ...]]] = {
    "layer_first": lambda p: (2, p.layer_num, p.size, p.head_num, p.head_dim),
    "page_first": lambda p: (2, p.size, p.layer_num, p.head_num, p.head_dim),
    "page_first_direct": lambda p: (2, p.page_num, p.layer_num, p.page_size, p.head_num, p.head_dim),
    "page_head": lambda p: (2, p.page_num, p.head_num, p.page_size, p.layer_num, p.head_dim),
    # PageUnifiedLayout.page_dims with one head group (grouped_dims: head_group_num groups)
    "page_unified": lambda p: (p.page_num, 1, p.layer_num, 2, p.page_size, p.head_num, p.head_dim),
}
#: The specs of page_unified with one kv head per head group (head_group_num = head_num), and with
#: 1 < head_group_num < head_num groups (its H split by a factor read from the pool's tensor).
PER_HEAD_LAYOUT, GROUPED_LAYOUT = "hicache_page_unified_per_head", "hicache_page_unified_grouped"


def grouped_dims(p: Any, groups: int) -> tuple[int, ...]:
    """PageUnifiedLayout.page_dims with `groups` head groups: [pages, G, L, 2, page, H / G, C]."""
    return (p.page_num, groups, p.layer_num, 2, p.page_size, int(p.head_num) // groups, p.head_dim)


#: MLATokenToKVPoolHost.init_kv_buffer's dims (D = kv_cache_dim, kv_lora_rank + qk_rope_head_dim).
MLA_DIMS: dict[str, Callable[[Any], tuple[int, ...]]] = {
    "layer_first": lambda p: (p.layer_num, p.size, 1, p.kv_cache_dim),
    "page_first": lambda p: (p.size, p.layer_num, 1, p.kv_cache_dim),
    "page_first_direct": lambda p: (p.page_num, p.layer_num, p.page_size, 1, p.kv_cache_dim),
    "page_unified": lambda p: (p.page_num, p.layer_num, p.page_size, p.kv_cache_dim),
}
#: The MiniMax M3 NVFP4 host mirrors' kv_buffer dims (page_first_direct keeps page_first's).
ROW_DIMS: dict[str, Callable[[Any], tuple[int, ...]]] = {
    "layer_first": lambda p: (p.layer_num, p.page_num, p.row_bytes),
    "page_first": lambda p: (p.page_num, p.layer_num, 1, p.row_bytes),
    "page_first_direct": lambda p: (p.page_num, p.layer_num, 1, p.row_bytes),
}
#: Host layout words of SGLang 0.5.23 with no kvgen spec yet, and what SGLang keeps under them.
NO_HOST_SPEC = {
    "page_first_kv_split": "Ascend's separate K and V buffers",
}
#: The specs host readers bind whose tree is one tensor (its layer count is the pool's layer_num): K and V, MLA.
HOST_LAYOUTS = frozenset({*(f"hicache_{w}" for w in MHA_DIMS), PER_HEAD_LAYOUT, GROUPED_LAYOUT})
HOST_MLA_LAYOUTS = frozenset(f"hicache_mla_{w}" for w in MLA_DIMS)


def _refuse(pool: Any, why: str) -> KVLayoutError:
    word = getattr(pool, "layout", None)
    return KVLayoutError(f"kvgen has no connector for SGLang's {type(pool).__name__} with layout {word!r}: {why}; "
                         f"kvgen reads MHATokenToKVPoolHost (layout {', '.join(map(repr, MHA_DIMS))}), "
                         f"MLATokenToKVPoolHost ({', '.join(map(repr, MLA_DIMS))}), and "
                         f"MiniMaxM3Nvfp4MainKVPoolHost and MiniMaxM3Nvfp4IndexKPoolHost "
                         f"({', '.join(map(repr, ROW_DIMS))})")


def _word(pool: Any, known: dict[str, Any], absent: dict[str, str] | None = None) -> str:
    """The pool's layout word, if `known` has it; `absent`: words SGLang has for the pool and kvgen no spec."""
    word, absent = str(pool.layout), absent or {}
    if word in absent:
        raise _refuse(pool, f"SGLang keeps {absent[word]} there, which no kvgen spec describes yet")
    if word not in known:
        raise _refuse(pool, "no kvgen spec describes this layout")
    return word


def _one_tensor(pool: Any, dims: tuple[int, ...]) -> Any:
    """The pool's kv_buffer, if it has the dims its fields name (init_kv_buffer's)."""
    buffer = getattr(pool, "kv_buffer", None)
    if buffer is None or tuple(buffer.shape) != tuple(int(d) for d in dims):
        shape = None if buffer is None else list(buffer.shape)
        raise _refuse(pool, f"its kv_buffer is {shape}, not the {list(dims)} its fields name")
    return buffer


def _mha_host(pool: Any) -> Read:
    """MHATokenToKVPoolHost: kv_buffer, K its [0] and V its [1], by layout word."""
    word = _word(pool, MHA_DIMS, NO_HOST_SPEC)
    v_dim = getattr(pool, "v_head_dim", pool.head_dim)
    if v_dim is not None and int(v_dim) != int(pool.head_dim):
        raise _refuse(pool, f"its V head size {v_dim} is not its K head size {pool.head_dim}, "
                            "which the hicache specs share")
    groups = int(getattr(pool, "head_group_num", 1) or 1)
    heads = int(pool.head_num)
    if word == "page_unified" and groups != 1:
        if heads % groups:
            raise _refuse(pool, f"its head_group_num={groups} does not divide its {heads} kv heads")
        # head_group_num decides, not the shape: [pages, G, L, 2, page, H / G, C] fits the grouped spec for any G
        layout = PER_HEAD_LAYOUT if groups == heads else GROUPED_LAYOUT
        return layout, _one_tensor(pool, grouped_dims(pool, groups)), {}
    return f"hicache_{word}", _one_tensor(pool, MHA_DIMS[word](pool)), {}


def _mla_host(pool: Any) -> Read:
    """MLATokenToKVPoolHost: kv_buffer, one latent row per (layer, slot), by layout word."""
    word = _word(pool, MLA_DIMS, NO_HOST_SPEC)
    if getattr(pool, "dsa_kv_cache_store_fp8", False):
        raise _refuse(pool, "its latent rows are packed fp8 with scales (dsa_kv_cache_store_fp8)")
    return f"hicache_mla_{word}", _one_tensor(pool, MLA_DIMS[word](pool)), {}


def _layer_rows(pool: Any, word: str, layer: int) -> Any:
    """One layer's [pages, row_bytes] host rows: a slice of kv_buffer, strided by L rows under page_first."""
    return pool.kv_buffer[layer] if word == "layer_first" else pool.kv_buffer[:, layer, 0]


def _minimax_rows(sides: str, device_class: str) -> Callable[[Any], Read]:
    """A MiniMax M3 NVFP4 host mirror: its one kv_buffer as per-layer views of the device spec's rows,
    `sides` 'kv' (the main pool's K and V) or 'k' (the index pool's K)."""
    def read(pool: Any) -> Read:
        word = _word(pool, ROW_DIMS)
        buffer = _one_tensor(pool, ROW_DIMS[word](pool))
        cells = _row_cells(pool, len(sides), str(buffer.dtype).removeprefix("torch."))
        views = [_layer_rows(pool, word, layer).view(int(pool.page_num), *cells) for layer in range(pool.layer_num)]
        layout = "sglang_minimax_m3_nvfp4" if sides == "kv" else "sglang_minimax_m3_nvfp4_index"
        return layout, views, {"pool": device_class}
    return read


def _row_cells(pool: Any, sides: int, dtype: str) -> tuple[int, ...]:
    """The device rows' cell view, (sides, heads, 128, 72) for K and V or (128, 72) for K alone; the host
    pool keeps no head count, so its row width must be a whole number of heads (one for the index)."""
    cell_row = sides * MINIMAX_PAGE * MINIMAX_CELL
    row_bytes, page = int(pool.row_bytes), int(pool.page_size)
    heads, rest = divmod(row_bytes, cell_row)
    if dtype != "uint8" or page != MINIMAX_PAGE or rest or not heads or (sides == 1 and heads != 1):
        want = f"a multiple of {cell_row}" if sides == 2 else str(cell_row)
        raise _refuse(pool, f"kvgen's spec for it is for uint8 rows, page_size {MINIMAX_PAGE} and rows of {want} "
                            f"bytes (heads of head_dim 128), not {dtype}, page_size {page} and {row_bytes}")
    return minimax_cells(sides, heads)


def minimax_cells(sides: int, heads: int) -> tuple[int, ...]:
    """A MiniMax M3 NVFP4 page row viewed by cell, as its specs read it: (sides, heads, 128, 72) for K and V,
    (128, 72) for the index pool's K alone."""
    return (sides, heads, MINIMAX_PAGE, MINIMAX_CELL) if sides == 2 else (MINIMAX_PAGE, MINIMAX_CELL)


#: SGLang 0.5.23 host pool classes, by exact class name, and how each hands its cache over.
HOST_READERS: dict[str, dict[str, Callable[[Any], Read]]] = {
    "MHATokenToKVPoolHost": {"kv": _mha_host},
    "MLATokenToKVPoolHost": {"kv": _mla_host},
    "MiniMaxM3Nvfp4MainKVPoolHost": {"kv": _minimax_rows("kv", "MiniMaxM3Nvfp4MainKVPool")},
    "MiniMaxM3Nvfp4IndexKPoolHost": {"indexer": _minimax_rows("k", "MiniMaxM3Nvfp4IndexKPool")},
}
