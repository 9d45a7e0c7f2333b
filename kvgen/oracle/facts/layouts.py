"""Facts about every built-in layout, written from the engines' and LMCache's own sources.

The reference (kvgen.oracle.address / reference) reads the same spec as the generator, so a
wrong spec makes both wrong together and every comparison still passes. This table does not
read specs at all: for a geometry it says, as each engine's or LMCache's source does,

- the containers the cache or object is handed over in (a list per layer, a (K, V) tuple, one
  tensor) and the tensor shape,
- the extents that source fixes as literals (the 2 of K and V),
- where element (layer, kv, slot or token, head, c) lives: a container path and a tensor index.

Each entry is plain arithmetic with a comment naming the source file and the function or
shape expression it comes from. `disagreement` compares a spec against its entry;
tests/test_facts.py runs it on every built-in spec and tests/test_spec_mutations.py shows that
every edit of a spec's lists, dims or sizes makes it fail.

Sources (projects as named on GitHub):

- vLLM (vllm-project/vllm): vllm/v1/attention/backends/flash_attn.py,
  vllm/v1/attention/backends/flashinfer.py, vllm/v1/attention/backends/mla/common.py,
  vllm/v1/kv_cache_layout.py, vllm/v1/worker/gpu_model_runner.py.
- vLLM plugins: vllm-project/vllm-ascend vllm_ascend/attention/attention_v1.py,
  rebellions-sw/vllm-rbln vllm_rbln/v1/attention/backends/flash_attention.py.
- SGLang (sgl-project/sglang): python/sglang/srt/mem_cache/memory_pool.py.
- Host pools and offload stores (SGLang HiCache, vLLM's canonical CPU offload, Dynamo KVBM):
  kvgen/oracle/facts/host.py, with their sources; SGLang 0.5.23's device pools in
  facts_sglang.py and vLLM 0.33's caches in facts_vllm.py. Each fills a table of its own
  (kvgen.oracle.facts.table.FactTable), merged below into FACTS.
- TensorRT-LLM (NVIDIA/TensorRT-LLM): cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp,
  cpp/tensorrt_llm/kernels/kvCacheUtils.h.
- LMCache 0.5.6 (LMCache/LMCache): lmcache/v1/memory_management.py (MemoryFormat),
  lmcache/v1/gpu_connector/gpu_connectors.py (get_shape of each connector),
  lmcache/v1/gpu_connector/kv_format/specs/*.py and kv_format/detectors/*.py.

A note on vLLM's HND-style layouts: vLLM's gpu_model_runner `_reshape_kv_cache_tensors`
allocates in the stride order of `get_kv_cache_stride_order` and hands the connector
`raw.view(physical_shape).permute(*inv_order)`, a view with the *logical* shape of
`get_kv_cache_shape` and permuted strides. The facts below give the physical-order view, the
shape LMCache's format names state (NL_X_TWO_NB_NH_BS_HS reads num_heads at shape[2]); the
logical vLLM view is that tensor permuted back.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from kvgen.oracle.agreement import address_disagreement
from kvgen.oracle.facts import host as facts_host
from kvgen.oracle.facts import sglang as facts_sglang
from kvgen.oracle.facts import vllm as facts_vllm
from kvgen.oracle.facts.groups import groups_disagreement
from kvgen.oracle.facts.planes import parts_disagreement
from kvgen.oracle.facts.table import (
    ONE_TENSOR,
    PER_LAYER,
    Address,
    EngineGeometry,
    Fact,
    FactTable,
    merge,
)
from kvgen.oracle.reference.layouts import leaf_shape
from kvgen.spec.model import Spec

#: This module's own entries (vLLM's device caches, TensorRT-LLM, LMCache's objects).
ENGINE_FACTS = FactTable()
_fact = ENGINE_FACTS.fact


# -- vLLM FlashAttention / FlashInfer / Triton: K and V as a size-2 axis -----------------------

# flash_attn.py FlashAttentionBackend.get_kv_cache_shape returns
# (2, num_blocks, block_size, num_kv_heads, head_size); get_kv_cache_stride_order for "NHD" is
# (0, 1, 2, 3, 4). One tensor per attention layer (kv_caches dict, a list by layer for LMCache:
# kv_format/specs/nl_x_two_nb_bs_nh_hs.py "NL x [2, NB, BS, NH, HS]").
@_fact("vllm_flash_attn_nhd", "paged", PER_LAYER, lambda g: (2, g.B, g.N, g.H, g.C),
       lmcache="NL_X_TWO_NB_BS_NH_HS")
def vllm_flash_attn_nhd(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (layer,), (kv, slot // g.N, slot % g.N, h, c)


# flash_attn.py get_kv_cache_stride_order for "HND" is (0, 1, 3, 2, 4): memory order
# (2, num_blocks, num_kv_heads, block_size, head_size); LMCache nl_x_two_nb_nh_bs_hs.py
# "NL x [2, NB, NH, BS, HS]", num_heads = shape[2], block_size = shape[3].
@_fact("vllm_flash_attn_hnd", "paged", PER_LAYER, lambda g: (2, g.B, g.H, g.N, g.C),
       lmcache="NL_X_TWO_NB_NH_BS_HS")
def vllm_flash_attn_hnd(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (layer,), (kv, slot // g.N, h, slot % g.N, c)


# flashinfer.py FlashInferBackend.get_kv_cache_shape returns
# (num_blocks, 2, block_size, num_kv_heads, head_size) (Triton's is the same); "NHD" stride
# order (0, 1, 2, 3, 4). LMCache nl_x_nb_two_bs_nh_hs.py "NL x [NB, 2, BS, NH, HS]".
@_fact("vllm_flashinfer_nhd", "paged", PER_LAYER, lambda g: (g.B, 2, g.N, g.H, g.C),
       lmcache="NL_X_NB_TWO_BS_NH_HS")
def vllm_flashinfer_nhd(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (layer,), (slot // g.N, kv, slot % g.N, h, c)


# flashinfer.py "HND" stride order (0, 1, 3, 2, 4): (num_blocks, 2, num_kv_heads, block_size,
# head_size); LMCache nl_x_nb_two_nh_bs_hs.py "NL x [NB, 2, NH, BS, HS]".
@_fact("vllm_flashinfer_hnd", "paged", PER_LAYER, lambda g: (g.B, 2, g.H, g.N, g.C),
       lmcache="NL_X_NB_TWO_NH_BS_HS")
def vllm_flashinfer_hnd(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (layer,), (slot // g.N, kv, h, slot % g.N, c)


# flash_attn.py get_kv_cache_stride_order(include_num_layers_dimension=True) for "NHD" is
# (2, 0, 1, 3, 4, 5), commented "(num_blocks, num_layers, 2, block_size, num_kv_heads,
# head_size)": one tensor for every layer. LMCache nb_nl_two_bs_nh_hs.py "a single bare tensor
# [NB, NL, 2, BS, NH, HS]" (vLLM CROSS_LAYER).
@_fact("vllm_cross_layer", "paged", ONE_TENSOR, lambda g: (g.B, g.L, 2, g.N, g.H, g.C),
       lmcache="NB_NL_TWO_BS_NH_HS")
def vllm_cross_layer(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (slot // g.N, layer, kv, slot % g.N, h, c)


# vllm-ascend attention_v1.py AscendAttentionBackend.get_kv_cache_shape returns
# (2, num_blocks, block_size, num_kv_heads, head_size), handed over split into a (K, V) tuple per
# layer: LMCache nl_x_two_x_nb_bs_nh_hs.py "NL x [(K, V) x [NB, BS, NH, HS]]", data_ptrs reads
# layers[i][0] as K and layers[i][1] as V.
@_fact("vllm_kv_tuple", "paged", (("list", "L"), ("tuple", "KV")), lambda g: (g.B, g.N, g.H, g.C),
       lmcache="NL_X_TWO_X_NB_BS_NH_HS")
def vllm_kv_tuple(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (layer, kv), (slot // g.N, slot % g.N, h, c)


# vllm-rbln flash_attention.py RBLNFlashAttentionBackend.get_kv_cache_shape returns
# (2, num_blocks, num_kv_heads, 1, block_size, head_size); LMCache nl_x_two_nb_nh_one_bs_hs.py
# "NL x [2, NB, NH, 1, BS, HS]".
@_fact("vllm_rbln", "paged", PER_LAYER, lambda g: (2, g.B, g.H, 1, g.N, g.C), lmcache="NL_X_TWO_NB_NH_ONE_BS_HS")
def vllm_rbln(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (layer,), (kv, slot // g.N, h, 0, slot % g.N, c)


# -- vLLM MLA: one latent plane per layer --------------------------------------------------------

# mla/common.py MLACommonBackend.get_kv_cache_shape returns (num_blocks, block_size, head_size)
# ("num_kv_heads assumed to be 1 for MLA"); stride order (0, 1, 2). LMCache nl_x_nb_bs_hs.py
# "NL x [NB, BS, HS]", K and V share one latent.
@_fact("vllm_mla", "paged", PER_LAYER, lambda g: (g.B, g.N, g.C), {}, mla=True, lmcache="NL_X_NB_BS_HS")
def vllm_mla(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (layer,), (slot // g.N, slot % g.N, c)


# -- vLLM unified cache (RFC #42082): K and V packed in the content axis -------------------------
# kv_cache_layout.py KVCacheLayout: "The logical shape is always [L, B, H, N, <content>]", each
# member a stride permutation: LBHNC = (0, 1, 2, 3, 4), LBNHC = (0, 1, 3, 2, 4),
# LHBNC = (0, 2, 1, 3, 4), BLHNC = (1, 0, 2, 3, 4), BLNHC = (1, 0, 3, 2, 4), BHLNC = (1, 2, 0, 3, 4).
# flash_attn.py FlashAttentionBackend.get_kv_cache_shape returns
# (num_blocks, num_kv_heads, block_size, 2 * head_size), "K and V are packed into the content dim:
# logical (B, H, N, 2*D)"; FlashAttentionImpl unpacks with
# `key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)`: K is the
# first head_size values of the content, V the rest. LMCache nl_x_nb_bs_nh_cs.py: "CS == 2 *
# head_size, K/V packed". Layer-first layouts are one tensor per layer, blocks-first ones one
# tensor (LMCache nb_nl_nh_bs_cs.py: "a single tensor [NB, NL, NH, BS, CS]").

# LBNHC: [L, B, N, H, 2C], NHD; LMCache nl_x_nb_bs_nh_cs.py "NL x [NB, BS, NH, CS]".
@_fact("vllm_packed_nhd", "paged", PER_LAYER, lambda g: (g.B, g.N, g.H, 2 * g.C), lmcache="NL_X_NB_BS_NH_CS")
def vllm_packed_nhd(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (layer,), (slot // g.N, slot % g.N, h, kv * g.C + c)


# LBHNC: [L, B, H, N, 2C], HND; LMCache nl_x_nb_nh_bs_cs.py "NL x [NB, NH, BS, CS]".
@_fact("vllm_packed_hnd", "paged", PER_LAYER, lambda g: (g.B, g.H, g.N, 2 * g.C), lmcache="NL_X_NB_NH_BS_CS")
def vllm_packed_hnd(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (layer,), (slot // g.N, h, slot % g.N, kv * g.C + c)


# LHBNC: [L, H, B, N, 2C]; LMCache refuses it (kv_format/types.py _UNSUPPORTED_KV_LAYOUTS).
@_fact("vllm_heads_first", "paged", PER_LAYER, lambda g: (g.H, g.B, g.N, 2 * g.C))
def vllm_heads_first(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (layer,), (h, slot // g.N, slot % g.N, kv * g.C + c)


# BLNHC: [B, L, N, H, 2C]; LMCache nb_nl_bs_nh_cs.py "[NB, NL, BS, NH, CS]".
@_fact("vllm_blocks_first_nhd", "paged", ONE_TENSOR, lambda g: (g.B, g.L, g.N, g.H, 2 * g.C),
       lmcache="NB_NL_BS_NH_CS")
def vllm_blocks_first_nhd(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (slot // g.N, layer, slot % g.N, h, kv * g.C + c)


# BLHNC: [B, L, H, N, 2C]; LMCache nb_nl_nh_bs_cs.py "[NB, NL, NH, BS, CS]".
@_fact("vllm_blocks_first_hnd", "paged", ONE_TENSOR, lambda g: (g.B, g.L, g.H, g.N, 2 * g.C),
       lmcache="NB_NL_NH_BS_CS")
def vllm_blocks_first_hnd(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (slot // g.N, layer, h, slot % g.N, kv * g.C + c)


# BHLNC: [B, H, L, N, 2C]; LMCache refuses it (kv_format/types.py _UNSUPPORTED_KV_LAYOUTS).
@_fact("vllm_blocks_heads_first", "paged", ONE_TENSOR, lambda g: (g.B, g.H, g.L, g.N, 2 * g.C))
def vllm_blocks_heads_first(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (slot // g.N, h, layer, slot % g.N, kv * g.C + c)


# -- SGLang: token pools indexed by slot (num_blocks * block_size rows) --------------------------

# memory_pool.py MHATokenToKVPool._create_buffers: k_buffer and v_buffer are each a list over
# layers of torch.zeros((size + page_size, head_num, head_dim)); LMCache hands them over as the
# pair (k_buffer, v_buffer): two_x_nl_x_nbbs_nh_hs.py "2 x NL x [PBS, NH, HS]", "[K_layers,
# V_layers]"; gpu_connectors.py SGLangGPUConnector: "kvcaches: Tuple[List[Tensor], List[Tensor]]".
@_fact("sglang_mha", "paged", (("seq", "KV"), ("list", "L")), lambda g: (g.B * g.N, g.H, g.C),
       lmcache="TWO_X_NL_X_NBBS_NH_HS")
def sglang_mha(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (kv, layer), (slot, h, c)


# memory_pool.py MLATokenToKVPool: kv_buffer is a list over layers of
# torch.zeros((size + page_size, 1, kv_lora_rank + qk_rope_head_dim)); LMCache nl_x_nbbs_one_hs.py
# "NL x [PBS, 1, HS]".
@_fact("sglang_mla", "paged", PER_LAYER, lambda g: (g.B * g.N, 1, g.C), {}, mla=True, lmcache="NL_X_NBBS_ONE_HS")
def sglang_mla(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (layer,), (slot, 0, c)


# -- TensorRT-LLM: one pool for every layer --------------------------------------------------------

# kvCacheManager.cpp BlockManager pool allocation: cacheShape = {mNumPrimaryBlocks, pool.numLayers,
# mKVFactor, blockSize} with blockSize = numKvHeads * sizePerHead * tokensPerBlock; inside a block
# kvCacheUtils.h KVBlockArray::getKVLocalIdx = headIdx * mTokensPerBlock * dimsPerHead +
# localTokenIdx * dimsPerHead + channelIdx, i.e. [heads, tokens, head_dim]. LMCache
# detectors/trtllm.py views that 4-D pool as [NB, NL, 2, num_kv_heads, tokens_per_block, head_dim]
# (trtllm_cross_layer.py "[NB, NL, 2, NH, BS, HS]"); the facts give that 6-D view.
@_fact("trtllm_pool", "paged", ONE_TENSOR, lambda g: (g.B, g.L, 2, g.H, g.N, g.C), lmcache="NB_NL_TWO_NH_BS_HS")
def trtllm_pool(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (), (slot // g.N, layer, kv, h, slot % g.N, c)


# -- LMCache memory objects ----------------------------------------------------------------------
# memory_management.py MemoryFormat documents each shape; hidden_dim is num_kv_heads * head_size
# (gpu_connectors.py from_metadata: kv_shape = (num_layer, 2, chunk_size, num_kv_head, head_size),
# hidden_dim_size = num_kv_head * head_size), so head h, value c sits at h * head_size + c.
# Layerwise connectors take memory_objs[layer][chunk]: a list with one object per layer.

# KV_2LTD = 1: "[2, num_layers, num_tokens, hidden_dim]"; VLLMPagedMemGPUConnectorV2.get_shape
# returns [kv_size, num_layers, num_tokens, hidden_dim_size] with kv_size 2.
@_fact("kv_2ltd", "object", ONE_TENSOR, lambda g: (2, g.L, g.T, g.H * g.C), lmcache="KV_2LTD", code=1)
def kv_2ltd(g: EngineGeometry, layer: int, kv: int, t: int, h: int, c: int) -> Address:
    return (), (kv, layer, t, h * g.C + c)


# KV_T2D = 2: "[num_tokens, 2, hidden_dim]"; VLLMPagedMemLayerwiseGPUConnector.get_shape returns
# [num_tokens, 2, hidden_dim_size], one object per layer.
@_fact("kv_t2d", "object", PER_LAYER, lambda g: (g.T, 2, g.H * g.C), lmcache="KV_T2D", code=2)
def kv_t2d(g: EngineGeometry, layer: int, kv: int, t: int, h: int, c: int) -> Address:
    return (layer,), (t, kv, h * g.C + c)


# KV_2TD = 3: "[2, num_tokens, hidden_dim]"; VLLMBufferLayerwiseGPUConnector.get_shape returns
# [2, num_tokens, hidden_dim_size], one object per layer.
@_fact("kv_2td", "object", PER_LAYER, lambda g: (2, g.T, g.H * g.C), lmcache="KV_2TD", code=3)
def kv_2td(g: EngineGeometry, layer: int, kv: int, t: int, h: int, c: int) -> Address:
    return (layer,), (kv, t, h * g.C + c)


# KV_MLA_FMT = 6: "[1, num_layers, num_tokens, aligned_head_size]"; VLLMPagedMemGPUConnectorV2
# get_shape with use_mla has kv_size 1.
@_fact("kv_mla", "object", ONE_TENSOR, lambda g: (1, g.L, g.T, g.C), {}, mla=True, lmcache="KV_MLA_FMT", code=6)
def kv_mla(g: EngineGeometry, layer: int, kv: int, t: int, h: int, c: int) -> Address:
    return (), (0, layer, t, c)


# KV_MLA_FMT per layer: VLLMPagedMemLayerwiseGPUConnector.get_shape with use_mla returns
# "MLA format: [num_tokens, hidden_dim_size]" (one head of the latent width).
@_fact("kv_mla_layer", "object", PER_LAYER, lambda g: (g.T, g.C), {}, mla=True, lmcache="KV_MLA_FMT", code=6)
def kv_mla_layer(g: EngineGeometry, layer: int, kv: int, t: int, h: int, c: int) -> Address:
    return (layer,), (t, c)


# -- the formats LMCache 0.5.6 added (lmcache/v1/gpu_connector/kv_format/specs/) -----------------

# nl_x_nb_bs_nh_two_hs.py: "Per-layer, NHD, blocks-first with fused K/V: NL x [NB, BS, NH, 2, HS]",
# "a 5-D tensor whose K/V (size-2) axis is second-to-last" (deprecated form of NL_X_NB_BS_NH_CS,
# whose content holds K first): kv selects along dim 3.
@_fact("vllm_packed_nhd_5d", "paged", PER_LAYER, lambda g: (g.B, g.N, g.H, 2, g.C), lmcache="NL_X_NB_BS_NH_TWO_HS")
def vllm_packed_nhd_5d(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (layer,), (slot // g.N, slot % g.N, h, kv, c)


# nl_x_nb_nh_bs_two_hs.py: "Per-layer, HND, blocks-first with fused K/V: NL x [NB, NH, BS, 2, HS]";
# num_heads = shape[1], block_size = shape[2].
@_fact("vllm_packed_hnd_5d", "paged", PER_LAYER, lambda g: (g.B, g.H, g.N, 2, g.C), lmcache="NL_X_NB_NH_BS_TWO_HS")
def vllm_packed_hnd_5d(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (layer,), (slot // g.N, h, slot % g.N, kv, c)


# two_x_nl_x_nb_bs_nh_hs.py: "Two-list MHA, split NB/BS: 2 x NL x [NB, BS, NH, HS] (SGLang MP daemon)",
# "[K_layers, V_layers]"; data_ptrs unpacks `k, v = kv_caches`.
@_fact("sglang_mha_blocks", "paged", (("seq", "KV"), ("list", "L")), lambda g: (g.B, g.N, g.H, g.C),
       lmcache="TWO_X_NL_X_NB_BS_NH_HS")
def sglang_mha_blocks(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (kv, layer), (slot // g.N, slot % g.N, h, c)


# nl_x_nb_bs_nh_hs.py: "Independent SGLang components: NL x [NB, BS, NH, HS]", "Each list entry is one
# physical K or V allocation ... NL is the number of registered component tensors"; kv_size() is 1.
@_fact("sglang_components", "paged", PER_LAYER, lambda g: (g.B, g.N, g.H, g.C), {}, single=True,
       lmcache="NL_X_NB_BS_NH_HS")
def sglang_components(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (layer,), (slot // g.N, slot % g.N, h, c)


# A kv_size-1 object with heads: VLLMPagedMemGPUConnectorV2.get_shape returns [kv_size, num_layers,
# num_tokens, hidden_dim_size] with kv_size 1 for one plane (labelled KV_MLA_FMT), hidden_dim = NH * HS;
# platform/torch_ops/mp_mem_kernels.py: "Single plane: hs is the complete per-head content width",
# chunk shape (nl, chunk_tokens, nh * hs).
@_fact("kv_1ltd", "object", ONE_TENSOR, lambda g: (1, g.L, g.T, g.H * g.C), {}, single=True, lmcache="KV_MLA_FMT",
       code=6)
def kv_1ltd(g: EngineGeometry, layer: int, kv: int, t: int, h: int, c: int) -> Address:
    return (), (0, layer, t, h * g.C + c)


# The per-layer form: VLLMPagedMemLayerwiseGPUConnector.get_shape for one plane is
# [num_tokens, hidden_dim_size], one object per layer.
@_fact("kv_1td", "object", PER_LAYER, lambda g: (g.T, g.H * g.C), {}, single=True, lmcache="KV_MLA_FMT", code=6)
def kv_1td(g: EngineGeometry, layer: int, kv: int, t: int, h: int, c: int) -> Address:
    return (layer,), (t, h * g.C + c)


# -- using the table ------------------------------------------------------------------------------

def extents(g: EngineGeometry) -> dict[str, int]:
    """The geometry as kvgen extents (axis letter -> size)."""
    return {"L": g.L, "KV": 2, "B": g.B, "N": g.N, "H": g.H, "C": g.C, "T": g.T}


#: Every built-in layout's entry, by spec name: this module's, then each source module's.
FACTS: dict[str, Fact] = merge(ENGINE_FACTS, facts_host.HOST_FACTS, facts_sglang.SGLANG_FACTS, facts_vllm.VLLM_FACTS)


def level_size(axis: str, g: EngineGeometry) -> int:
    return 2 if axis == "KV" else getattr(g, axis)


def positions(fact: Fact, g: EngineGeometry) -> int:
    """Slots of a cache, tokens of an object."""
    return g.B * g.N if fact.kind == "paged" else g.T


def element_sizes(fact: Fact, g: EngineGeometry) -> tuple[int, int, int, int, int]:
    """How many l, kv, pos, h and c the layout holds."""
    planes, heads = (1, 1) if fact.mla else ((1, g.H) if fact.single else (2, g.H))
    return g.L, planes, positions(fact, g), heads, g.C


def elements(fact: Fact, g: EngineGeometry) -> Iterator[tuple[int, int, int, int, int]]:
    """Every (l, kv, pos, h, c) the layout holds."""
    return itertools.product(*(range(n) for n in element_sizes(fact, g)))


def disagreement(spec: Spec, g: EngineGeometry) -> str | None:
    """The first way `spec` differs from the facts about the layout it names, or None."""
    if spec.carries is not None:  # a model's groups object
        return groups_disagreement(spec)
    if not spec.is_simple:  # format 2: parts, fields, packed objects
        return parts_disagreement(spec, g)
    fact = FACTS.get(spec.name)
    if fact is None:
        return f"no fact entry for {spec.name}"
    if spec.kind != fact.kind:
        return f"kind {spec.kind}, the source says {fact.kind}"
    claimed = spec.lmcache_format if spec.is_paged else spec.format
    if claimed != fact.lmcache:
        return f"LMCache format {claimed}, the source says {fact.lmcache}"
    if not spec.is_paged and spec.code != fact.code:
        return f"format code {spec.code}, LMCache's is {fact.code}"
    if dict(spec.sizes) != dict(fact.fixed):
        return f"sizes {dict(spec.sizes)}, the source fixes {dict(fact.fixed)}"
    if spec.token_ratio != (1, fact.pool):
        return f"token ratio {spec.token_ratio} (tokens, slots), the source stores a token as {fact.pool} state(s)"
    levels = tuple(axis for _, axis in fact.container)
    if spec.lists != levels:
        return f"lists {list(spec.lists)}, the source hands over {list(levels)}"
    ext = extents(g)
    if leaf_shape(spec, ext) != fact.shape(g):
        return f"shape {leaf_shape(spec, ext)} at {g}, the source says {fact.shape(g)}"
    return address_disagreement(spec, ext, lambda *e: fact.address(g, *e), element_sizes(fact, g), g)

