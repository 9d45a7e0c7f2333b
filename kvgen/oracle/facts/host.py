"""Facts about the host pools and offload stores that layout-to-layout transfers reach, written
from the engines' own sources; merged into kvgen.oracle.facts.FACTS, so every test and
`kvgen verify` check them like the engine layouts.

Sources (projects as named on GitHub): SGLang (sgl-project/sglang)
python/sglang/srt/mem_cache/pool_host/mha.py, mla.py, page_unified.py and base.py; vLLM (vllm-project/vllm)
vllm/v1/kv_offload/sharding.py and vllm/v1/kv_offload/cpu/common.py; Dynamo (ai-dynamo/dynamo)
lib/kvbm-kernels/README.md.
"""

from __future__ import annotations

from kvgen.oracle.facts.table import ONE_TENSOR, Address, EngineGeometry, FactTable

#: The host pools and offload stores, by spec name (kvgen.oracle.facts.layouts merges them into FACTS).
HOST_FACTS = FactTable()
_fact = HOST_FACTS.fact

# -- Host pools and offload stores (the far side of layout-to-layout transfers) -------------------

# SGLang HiCache host pools (python/sglang/srt/mem_cache/pool_host/mha.py and mla.py, older releases
# memory_pool_host.py). HostKVCache.__init__ (pool_host/base.py) rounds the host size up to whole
# pages: page_num = size // page_size + 1, size = page_num * page_size, so a host slot is a token
# row and `size` is num_blocks * block_size. Each pool is one tensor, `kv_buffer`.

# MHATokenToKVPoolHost.init_kv_buffer, layout "layer_first": dims (2, layer_num, size, head_num,
# head_dim); k_buffer is kv_buffer[0], v_buffer kv_buffer[1].
@_fact("hicache_layer_first", "paged", ONE_TENSOR, lambda g: (2, g.L, g.B * g.N, g.H, g.C))
def hicache_layer_first(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (kv, layer, slot, h, c)


# layout "page_first": dims (2, size, layer_num, head_num, head_dim) (per-layer views are
# kv_buffer[i].transpose(0, 1)[layer]).
@_fact("hicache_page_first", "paged", ONE_TENSOR, lambda g: (2, g.B * g.N, g.L, g.H, g.C))
def hicache_page_first(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (kv, slot, layer, h, c)


# layout "page_first_direct": dims (2, page_num, layer_num, page_size, head_num, head_dim); a host
# slot is page slot // page_size, row slot % page_size (transfer_kv_per_layer_direct_pf_lf copies
# whole pages).
@_fact("hicache_page_first_direct", "paged", ONE_TENSOR, lambda g: (2, g.B, g.L, g.N, g.H, g.C))
def hicache_page_first_direct(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (kv, slot // g.N, layer, slot % g.N, h, c)


# layout "page_head" (SGLang 0.5.23): dims (2, page_num, head_num, page_size, layer_num, head_dim); a
# page keeps each head's tokens together, every layer's row of a (head, token) side by side.
@_fact("hicache_page_head", "paged", ONE_TENSOR, lambda g: (2, g.B, g.H, g.N, g.L, g.C))
def hicache_page_head(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (kv, slot // g.N, h, slot % g.N, layer, c)


# layout "page_unified" (SGLang 0.5.23, pool_host/page_unified.py PageUnifiedLayout.page_dims): dims
# (page_num, head_group_num, layer_num, 2, page_size, head_num // head_group_num, head_dim); K and V
# sit inside the layer, so a (group, layer) cell is one run. Head h of group g is g * (H / G) + j;
# kvgen describes head_group_num = 1 (SGLang's default: group 0, j = h) and, below, head_group_num =
# head_num (one head per group, HiCache's head_group 1: group h, j = 0).
@_fact("hicache_page_unified", "paged", ONE_TENSOR, lambda g: (g.B, 1, g.L, 2, g.N, g.H, g.C))
def hicache_page_unified(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (slot // g.N, 0, layer, kv, slot % g.N, h, c)


@_fact("hicache_page_unified_per_head", "paged", ONE_TENSOR, lambda g: (g.B, g.H, g.L, 2, g.N, 1, g.C))
def hicache_page_unified_per_head(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (slot // g.N, h, layer, kv, slot % g.N, 0, c)


# MLATokenToKVPoolHost.init_kv_buffer: "layer_first" dims (layer_num, size, 1, kv_cache_dim) with
# kv_cache_dim = kv_lora_rank + qk_rope_head_dim; one latent, no K/V planes.
@_fact("hicache_mla_layer_first", "paged", ONE_TENSOR, lambda g: (g.L, g.B * g.N, 1, g.C), {}, mla=True)
def hicache_mla_layer_first(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (layer, slot, 0, c)


# "page_first": dims (size, layer_num, 1, kv_cache_dim).
@_fact("hicache_mla_page_first", "paged", ONE_TENSOR, lambda g: (g.B * g.N, g.L, 1, g.C), {}, mla=True)
def hicache_mla_page_first(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (slot, layer, 0, c)


# "page_first_direct": dims (page_num, layer_num, page_size, 1, kv_cache_dim).
@_fact("hicache_mla_page_first_direct", "paged", ONE_TENSOR, lambda g: (g.B, g.L, g.N, 1, g.C), {}, mla=True)
def hicache_mla_page_first_direct(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (slot // g.N, layer, slot % g.N, 0, c)


# "page_unified" (SGLang 0.5.23, PageUnifiedLayout.page_dims with is_mla): dims (page_num, layer_num,
# page_size, kv_cache_dim), page_first_direct's bytes with no singleton head axis.
@_fact("hicache_mla_page_unified", "paged", ONE_TENSOR, lambda g: (g.B, g.L, g.N, g.C), {}, mla=True)
def hicache_mla_page_unified(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (slot // g.N, layer, slot % g.N, c)


# vLLM canonical CPU offload (vllm-project/vllm PRs #48408 / #48414): vllm/v1/kv_offload/sharding.py
# defines each layer's canonical page as the whole block with all KV heads. For split K/V in NHD order
# `_attention_channels` places region r (K = 0, V = 1), token t, global head h at byte
# ((r * block_size + t) * total_heads + h) * head_size * element_size: a page [2, N, H, C].
# vllm/v1/kv_offload/cpu/common.py lays a CPU row (one offloaded block) out as the layers' canonical
# pages one after another (canonical_offset grows by canonical_page_size_bytes per layer), so the
# CPU region is [num_blocks, L, 2, N, H, C] (format identity "v1-nhd").
@_fact("vllm_offload_nhd", "paged", ONE_TENSOR, lambda g: (g.B, g.L, 2, g.N, g.H, g.C))
def vllm_offload_nhd(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (slot // g.N, layer, kv, slot % g.N, h, c)


# vLLM 0.33 (distributed/kv_transfer/kv_connector/v1/offloading/canonical_mapping.py): layers are
# packed [B, H, N, (K V) C] views, so `_packed_kv_regions` keeps K then V per head: with NHD strides
# (LBNHC) a token row of all heads, the page [N, H, 2C] ("v1-nhd"); with HND strides (LBHNC) each
# head's run of tokens at its global head index, the page [H, N, 2C] ("v1-hnd").
# shared_offload_region.py create_next_canonical_view carves the layers' pages one after another
# from the start of each CPU row.
@_fact("vllm_canonical_lbnhc", "paged", ONE_TENSOR, lambda g: (g.B, g.L, g.N, g.H, 2 * g.C))
def vllm_canonical_lbnhc(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (slot // g.N, layer, slot % g.N, h, kv * g.C + c)


@_fact("vllm_canonical_lbhnc", "paged", ONE_TENSOR, lambda g: (g.B, g.L, g.H, g.N, 2 * g.C))
def vllm_canonical_lbhnc(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (slot // g.N, layer, h, slot % g.N, kv * g.C + c)


# sharding.py `_layer_mapping` for MLAAttentionSpec: the latent is TP-replicated, one row of
# page_size_bytes // block_size per token, stored once (only TP rank 0 writes): a page [N, C], rows
# of layers as above: [num_blocks, L, N, C].
@_fact("vllm_offload_mla", "paged", ONE_TENSOR, lambda g: (g.B, g.L, g.N, g.C), {}, mla=True)
def vllm_offload_mla(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (slot // g.N, layer, slot % g.N, c)


# Dynamo KVBM (ai-dynamo/dynamo lib/kvbm-kernels/README.md, "Layout Cheat Sheet"): a universal
# block is one contiguous buffer [nh, nl, no, nt, hd] (heads, layers, K/V, tokens, head dim), heads
# outermost so that any TP size reads its heads as one slice; a pool of them is
# [num_blocks, H, L, 2, N, C].
@_fact("dynamo_universal", "paged", ONE_TENSOR, lambda g: (g.B, g.H, g.L, 2, g.N, g.C))
def dynamo_universal(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (slot // g.N, h, layer, kv, slot % g.N, c)

