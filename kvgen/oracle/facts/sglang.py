"""Facts about SGLang 0.5.23's device pools beyond kvgen/oracle/facts/layouts.py, written from
sglang/srt/mem_cache/memory_pool.py; merged into kvgen.oracle.facts.FACTS, so every test and
`kvgen verify` check them like the other layouts.
"""

from __future__ import annotations

from kvgen.oracle.facts.table import Address, EngineGeometry, FactTable

#: The SGLang 0.5.23's device pools, by spec name (kvgen.oracle.facts.layouts merges them into FACTS).
SGLANG_FACTS = FactTable()
_fact = SGLANG_FACTS.fact


# MHATokenToKVPool with SGLANG_USE_HND_KVCACHE=1 (kv_cache_layout "hnd"): _kv_buffer_shapes gives
# (num_pages, head_num, page_size, head_dim) for K and for V, num_pages = (size + page_size) //
# page_size; _create_buffers_normal keeps them as buf[0] and buf[1] of one fused [2, pages, H, page,
# C] tensor per layer, handed over as (k_buffer, v_buffer) lists like the NHD pool; set_kv_buffer
# writes slot `loc` at k_buf[loc // page_size, :, loc % page_size, :].
@_fact("sglang_mha_hnd", "paged", (("seq", "KV"), ("list", "L")), lambda g: (g.B, g.H, g.N, g.C))
def sglang_mha_hnd(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (kv, layer), (slot // g.N, h, slot % g.N, c)
