"""Facts about vLLM 0.33's caches, written from its own sources; merged into
kvgen.oracle.facts.FACTS, so every test and `kvgen verify` check them like the other
layouts. tests/test_engine_vllm.py compares them with vLLM's live answer
where vllm is installed.

Sources (vllm-project/vllm 0.33.0): vllm/v1/kv_cache_layout.py (KVCacheLayout: "The logical
shape is always [L, B, H, N, <content>]", each member a stride permutation, `layer_view_order`
the physical order of one layer's 4-D view), vllm/v1/kv_cache_interface.py
(compute_layer_kv_cache_shape_bytes: the 4-D logical shape (B, H, N, C) with C in bytes;
create_kv_cache_views: one `as_strided` view of the int8 buffer per layer, then `.view(dtype)`;
AttentionSpec.state_content_size_bytes: (head_size + head_size_v) * dtype size, K then V;
MLAAttentionSpec: head_size_v = 0, one head slot), vllm/v1/worker/utils.py (allocate_kv_cache:
a dict layer name -> that view, in the tensor's layer order).
"""

from __future__ import annotations

from kvgen.oracle.facts.table import PER_LAYER, Address, EngineGeometry, FactTable

#: The vLLM 0.33's caches, by spec name (kvgen.oracle.facts.layouts merges them into FACTS).
VLLM_FACTS = FactTable()
_fact = VLLM_FACTS.fact

#: KVCacheLayout members as kv_cache_layout.py writes them: the physical order of the logical
#: axes L=0, B=1, H=2, N=3, C=4.
KV_CACHE_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
#: Legacy names vLLM 0.33 still accepts for VLLM_KV_CACHE_LAYOUT (kv_cache_layout.py).
LEGACY = {"NHD": "LBNHC", "HND": "LBHNC"}
#: The built-in spec for each KVCacheLayout; MLA caches (one head slot) are one spec for all.
SPEC_OF = {name: f"vllm_{name.lower()}" for name in KV_CACHE_LAYOUTS}
MLA_SPEC = "vllm_mla_latent"
#: The order every layer is handed over in: the logical [B, H, N, C] (C = K then V content).
HANDED_OVER = ("B", "H", "N", "C")


def layer_view_order(layout: str) -> tuple[int, ...]:
    """KVCacheLayout.layer_view_order: the physical order of a layer's logical [B, H, N, C]."""
    return tuple(i - 1 for i in KV_CACHE_LAYOUTS[layout] if i != 0)


def _register(layout: str, name: str | None = None, pool: int = 1) -> None:
    order = layer_view_order(layout)

    def shape(g: EngineGeometry) -> tuple[int, ...]:
        logical = (g.B, g.H, g.N, 2 * g.C)
        return tuple(logical[i] for i in order)

    def address(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
        logical = (slot // g.N, h, slot % g.N, kv * g.C + c)  # K first, then V, in the content
        return (layer,), tuple(logical[i] for i in order)

    _fact(name or SPEC_OF[layout], "paged", PER_LAYER, shape, pool=pool)(address)


for _layout in KV_CACHE_LAYOUTS:
    _register(_layout)

# Whisper block pooling (vllm/v1/attention/backends/whisper_causal.py, get_kv_cache_spec:
# tokens_per_state = Fraction(1, block_pool_size)): AttentionSpec.num_states gives a block of
# block_size tokens block_size * pool states, and create_kv_cache_views the layout's view over
# them, so N counts states and a stored slot is a state: the KVCacheLayout's own addresses. Which
# states hold a token (its manager slot s: states s * pool .. s * pool + pool - 1, the attention
# builder's expansion) is kvgen.oracle.address.stored_slots; tests/test_engine_vllm.py checks both.
_register("LBNHC", "vllm_whisper_pooled4", pool=4)
_register("LBHNC", "vllm_whisper_pooled4_hnd", pool=4)
_register("LHBNC", "vllm_whisper_pooled4_heads_first", pool=4)


# MLAAttentionSpec: num_kv_heads 1 and head_size_v 0, so the logical view is [B, 1, N, C] with C
# the latent (kv_lora_rank + qk_rope_head_dim); one head slot puts the same bytes in the same
# order under every layout.
@_fact(MLA_SPEC, "paged", PER_LAYER, lambda g: (g.B, 1, g.N, g.C), {}, mla=True)
def vllm_mla_latent(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> Address:
    return (layer,), (slot // g.N, 0, slot % g.N, c)
