"""vLLM 0.33's DeepSeek-V4 caches as the oracle for the deepseek_v4_flash model spec.

The per-layer KV cache specs are vLLM's own: DeepseekV4SWACache, CompressorStateCache and
DeepseekV4IndexerCache build theirs, and DeepseekV4Attention.get_kv_cache_spec the compressed
cache's (called on the few attributes it reads: its __init__ builds the model's linear layers), for
the 43 layers of the config, kv_cache_dtype fp8_ds_mla. vLLM groups them (get_kv_cache_groups, a
block-outermost layout: compressed caches must be packed), plans one allocation
(get_kv_cache_config_from_groups), views it per layer (allocate_kv_cache) and lists the views for
a connector (bind_kv_cache). The whole backing allocation is filled with distinct 4-byte words, so
every byte of every group codes its place in the per-block slab. kvgen stores each group's slots
(a compressed group's one per state) into one kv_groups object and loads it into a fresh vLLM
allocation; the fresh one must hold exactly the moved tokens' bytes at the offsets vLLM's kernels
use (fp8_ds_mla: a token's 576 data bytes at n * 576 of its block, its 8 scale bytes at
N * 576 + n * 8; indexer keys: 128 values at n * 128, the scale at N * 128 + n * 4; compressor
states: row n) and zeros everywhere else. Reading the same pages as plain 584-byte rows moves
other bytes, and fails the same check.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness import builtin_library, vllm_module

iface = vllm_module("vllm.v1.kv_cache_interface")

DSV4_ATTENTION = "vllm.models.deepseek_v4.attention"
dsv4_attention = vllm_module(DSV4_ATTENTION)
DSV4_COMPRESSOR = "vllm.models.deepseek_v4.compressor"
dsv4_compressor = vllm_module(DSV4_COMPRESSOR)
platforms = vllm_module("vllm.platforms")
SPARSE_SWA = "vllm.v1.attention.backends.mla.sparse_swa"
sparse_swa = vllm_module(SPARSE_SWA)
planning = vllm_module("vllm.v1.core.kv_cache_planning")
worker = vllm_module("vllm.v1.worker.utils")
vllm_layouts = vllm_module("vllm.v1.kv_cache_layout")

from kvgen import generated  # noqa: E402
from kvgen.oracle.facts.models import DEEPSEEK_V4_FLASH  # noqa: E402
from kvgen.runtime import KVLayoutError, MemoryObj  # noqa: E402

LIBRARY = builtin_library()
MODEL = LIBRARY.model("deepseek_v4_flash")
#: vLLM's DeepSeek-V4 block (the compressor's "KV block shape [256 // 4, head_dim]").
BLOCK_SIZE = 256
LAYOUT = "BLNHC"
#: Two blocks per vLLM block table (five of them), apart from each other: they overlay in the slab.
BLOCKS = 10
#: One chunk of a request: tokens [0, 256), two HCA states, 64 CSA and indexer states.
TOKENS = 256
#: fp8_ds_mla per token: data bytes (448 fp8 NoPE + 64 bf16 RoPE), then scale bytes, per block.
DATA, SCALE = 576, 8
INDEX_DATA, INDEX_SCALE = 128, 4


class _Context:
    """What the cache modules ask of get_current_vllm_config(): the forward context they register in."""

    def __init__(self) -> None:
        self.compilation_config = SimpleNamespace(static_forward_context={})


def _vllm_config() -> Any:
    """The VllmConfig fields vLLM's grouping and planning read (a whole VllmConfig needs a model)."""
    cache = SimpleNamespace(cache_dtype="fp8_ds_mla", block_size=BLOCK_SIZE, num_gpu_blocks_override=BLOCKS,
                            get_resolved_kv_cache_layout=lambda: vllm_layouts.KVCacheLayout[LAYOUT],
                            prefix_cache_retention_interval=None)
    return SimpleNamespace(cache_config=cache, scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
                           attention_config=SimpleNamespace(hisparse_config=None))


def _layer_specs(vc: Any) -> dict[str, Any]:
    """Every cache of every decoder layer, built by vLLM's own cache classes, in registration order."""
    cc = vc.cache_config
    head, index_head = DEEPSEEK_V4_FLASH["head_dim"], DEEPSEEK_V4_FLASH["index_head_dim"]
    specs: dict[str, Any] = {}
    for i, kind in enumerate(DEEPSEEK_V4_FLASH["layer_types"]):
        ratio = DEEPSEEK_V4_FLASH["compress_rates"][kind]
        p = f"model.layers.{i}.attn"
        caches: list[Any] = []
        if ratio == 4:  # the indexer (k_cache, then its compressor's state) is built before the attention
            caches.append(dsv4_attention.DeepseekV4IndexerCache(head_dim=index_head + index_head // 128 * 4,
                                                                dtype=torch.uint8, prefix=f"{p}.indexer.k_cache",
                                                                cache_config=cc, compress_ratio=ratio))
            caches.append(dsv4_compressor.CompressorStateCache(state_dim=2 * 2 * index_head, dtype=torch.float32,
                                                               compress_ratio=ratio,
                                                               prefix=f"{p}.indexer.compressor.state_cache"))
        caches.append(sparse_swa.DeepseekV4SWACache(head_dim=head, window_size=DEEPSEEK_V4_FLASH["sliding_window"],
                                                    dtype=torch.uint8, prefix=f"{p}.swa_cache", cache_config=cc))
        for cache in caches:
            specs[cache.prefix] = cache.get_kv_cache_spec(vc)
        attention = SimpleNamespace(compress_ratio=ratio, kv_cache_dtype="fp8_ds_mla", head_dim=head,
                                    kv_cache_torch_dtype=torch.uint8)
        specs[p] = dsv4_attention.DeepseekV4Attention.get_kv_cache_spec(attention, vc)
        state = dsv4_compressor.CompressorStateCache(state_dim=2 * (1 + (ratio == 4)) * head, dtype=torch.float32,
                                                     compress_ratio=ratio, prefix=f"{p}.compressor.state_cache")
        specs[state.prefix] = state.get_kv_cache_spec(vc)
    return specs


@pytest.fixture(scope="module")
def engine() -> Iterator[SimpleNamespace]:
    """vLLM's specs, groups and plan for the model, and a function making a fresh allocation."""
    with pytest.MonkeyPatch.context() as mp:
        context = _Context()
        for module in (SPARSE_SWA, DSV4_ATTENTION, DSV4_COMPRESSOR):  # by name: the real modules, not their proxies
            mp.setattr(f"{module}.get_current_vllm_config", lambda: context)
        # Several caches per decoder layer: CUDA's model runner lists them all (CudaPlatform's check is a no-op).
        mp.setattr(platforms.current_platform, "check_runner_kv_caches_multi_layer", lambda: None)
        vc = _vllm_config()
        specs = _layer_specs(vc)
        groups = planning.get_kv_cache_groups(vc, specs)
        config = planning.get_kv_cache_config_from_groups(vc, groups, 1 << 30)

        def allocate() -> SimpleNamespace:
            kv = worker.allocate_kv_cache(config, torch.device("cpu"), vllm_layouts.KVCacheLayout[LAYOUT])
            runner: list[torch.Tensor] = []
            worker.bind_kv_cache(kv, {name: SimpleNamespace(bind_kv_cache=lambda t: None) for name in kv}, runner)
            name_of = {id(t): name for name, t in kv.items()}
            first = next(iter(kv.values()))
            backing = torch.tensor([], dtype=torch.uint8).set_(first.untyped_storage())
            return SimpleNamespace(kv=kv, runner=runner, names=[name_of[id(t)] for t in runner], backing=backing)

        yield SimpleNamespace(specs=specs, groups=groups, config=config, allocate=allocate)


def _group_of(engine: SimpleNamespace, name: str) -> int:
    return next(i for i, g in enumerate(engine.groups) if name in g.layer_names)


def test_the_model_spec_lists_vllms_caches_in_its_order_with_their_geometry(engine: SimpleNamespace) -> None:
    cache = engine.allocate()
    assert MODEL.layers == len(cache.names)
    for g in MODEL.groups:
        names = [cache.names[i] for i in g.layers]
        assert len({_group_of(engine, n) for n in names}) == 1, g.name  # one vLLM block table per group
        layout = LIBRARY[g.layout]
        for name in names:
            spec, view = engine.specs[name], cache.kv[name]
            assert spec.tokens_per_state == g.tokens_per_slot, (g.name, name)
            assert getattr(spec, "sliding_window", None) == g.window, (g.name, name)
            assert view.shape[1] == 1 and view.shape[3] == g.size("C"), (g.name, name, view.shape)
            assert view.shape[2] == spec.block_size // spec.tokens_per_state  # N: the states of a block
            assert g.size("N") in (None, view.shape[2]), (g.name, name)
            assert str(view.dtype).removeprefix("torch.") in (g.dtypes or layout.dtypes), (g.name, name)


def test_every_group_lies_in_one_per_block_slab(engine: SimpleNamespace) -> None:
    """vLLM #44577: block b of every layer of every group starts at b * slab + the layer's offset."""
    cache = engine.allocate()
    (slab,) = {t.block_stride for t in engine.config.kv_cache_tensors}
    base = cache.backing.data_ptr()
    for t in engine.config.kv_cache_tensors:
        for k, name in enumerate(t.layers):
            view = cache.kv[name]
            assert view.stride(0) * view.element_size() == slab, name
            assert view.data_ptr() - base == t.offset + k * t.layer_stride, name
    # the groups overlay each other: each one's pages start at byte 0 of the slab
    assert {min(t.offset for t in engine.config.kv_cache_tensors if set(t.layers) & set(g.layer_names))
            for g in engine.groups} == {0}


def _fill(backing: torch.Tensor) -> None:
    """Every 4 bytes of the allocation get a distinct non-zero word: each byte codes its place."""
    words = backing.numel() // 4
    backing[:4 * words].view(torch.int32).copy_(torch.arange(1, words + 1, dtype=torch.int32))


def _slot_mappings(engine: SimpleNamespace, cache: SimpleNamespace) -> dict[str, list[int]]:
    """Per group, scattered slots (some -1, partial blocks) in blocks of its own vLLM block table:
    the vLLM groups get blocks apart, as the block pool gives them (they overlay in the slab)."""
    out = {}
    for g in MODEL.groups:
        vllm_group = _group_of(engine, cache.names[g.layers[0]])
        n = cache.kv[cache.names[g.layers[0]]].shape[2]
        first = 2 * vllm_group  # this block table's two blocks
        states = TOKENS // g.tokens_per_slot
        kept = min(states, 2 * n)  # the last 2 * n states (a window); the earlier ones -1
        slots = [-1] * (states - kept) + [first * n + (7 * s + 3) % (2 * n) for s in range(kept)]  # 2n: a power of 2
        out[g.name] = [-1 if s % 5 == 1 else slot for s, slot in enumerate(slots)]
    return out


def _moved_bytes(layout: str, view: torch.Tensor, slot: int) -> list[tuple[int, int]]:
    """(start, stop) of slot's bytes in the allocation, where vLLM's kernels read them."""
    n = view.shape[2]
    block, at = divmod(slot, n)
    start = view[block].data_ptr() - view.untyped_storage().data_ptr()
    if layout == "vllm_dsv4_mla_fp8":
        return [(start + at * DATA, start + (at + 1) * DATA), (start + n * DATA + at * SCALE,
                                                               start + n * DATA + (at + 1) * SCALE)]
    if layout == "vllm_dsv4_indexer":
        return [(start + at * INDEX_DATA, start + (at + 1) * INDEX_DATA),
                (start + n * INDEX_DATA + at * INDEX_SCALE, start + n * INDEX_DATA + (at + 1) * INDEX_SCALE)]
    row = view.shape[3] * view.element_size()
    return [(start + at * row, start + (at + 1) * row)]


def _expected_mask(cache: SimpleNamespace, maps: dict[str, list[int]]) -> torch.Tensor:
    mask = torch.zeros(cache.backing.numel(), dtype=torch.bool)
    for g in MODEL.groups:
        for i in g.layers:
            view = cache.kv[cache.names[i]]
            for slot in maps[g.name]:
                if slot >= 0:
                    for start, stop in _moved_bytes(g.layout, view, slot):
                        mask[start:stop] = True
    return mask


def _roundtrip(engine: SimpleNamespace, connector: Any) -> tuple[SimpleNamespace, SimpleNamespace, Any]:
    cache, fresh = engine.allocate(), engine.allocate()
    _fill(cache.backing)
    maps = _slot_mappings(engine, cache)
    tensors = {g: torch.tensor(m) for g, m in maps.items()}
    obj = torch.zeros(connector.get_shape(TOKENS, cache.runner), dtype=torch.uint8)
    connector.from_gpu(obj, 0, TOKENS, kvcaches=cache.runner, slot_mappings=tensors)
    connector.to_gpu(obj, 0, TOKENS, kvcaches=fresh.runner, slot_mappings=tensors)
    return cache, fresh, maps


def test_every_group_moves_both_ways_at_vllms_offsets(engine: SimpleNamespace) -> None:
    connector = generated.get_model("deepseek_v4_flash", "kv_groups")()
    cache, fresh, maps = _roundtrip(engine, connector)
    mask = _expected_mask(cache, maps)
    assert mask.sum() > 0
    assert torch.equal(fresh.backing[mask], cache.backing[mask])  # every moved byte where vLLM reads it
    assert not fresh.backing[~mask].any()  # and nothing else written


def test_the_object_holds_each_states_bytes_at_its_place(engine: SimpleNamespace) -> None:
    """The HCA group's section: per layer its data region [T / 128, 576], then its scales [T / 128, 8]."""
    connector = generated.get_model("deepseek_v4_flash", "kv_groups")()
    cache = engine.allocate()
    _fill(cache.backing)
    maps = _slot_mappings(engine, cache)
    obj = torch.zeros(connector.get_shape(TOKENS, cache.runner), dtype=torch.uint8)
    connector.from_gpu(obj, 0, TOKENS, kvcaches=cache.runner, slot_mappings={g: torch.tensor(m) for g, m in
                                                                            maps.items()})
    hca = next(g for g in MODEL.groups if g.name == "hca")
    rows = connector.member_view(obj, "hca", TOKENS, cache.runner)  # kv_planes: [L, bytes]
    states = TOKENS // hca.tokens_per_slot
    for k, i in enumerate(hca.layers):
        view = cache.kv[cache.names[i]]
        data = rows[k, :states * DATA].reshape(states, DATA)
        scale_at = -(-states * DATA // 16) * 16
        scale = rows[k, scale_at:scale_at + states * SCALE].reshape(states, SCALE)
        for t, slot in enumerate(maps["hca"]):
            if slot < 0:
                continue
            (d0, d1), (s0, s1) = _moved_bytes("vllm_dsv4_mla_fp8", view, slot)
            assert torch.equal(data[t], cache.backing[d0:d1]), (i, t)
            assert torch.equal(scale[t], cache.backing[s0:s1]), (i, t)


def test_pages_read_as_plain_584_byte_rows_move_other_bytes(engine: SimpleNamespace) -> None:
    """vllm_mla_latent (rows of C bytes) fits the same views, but a token's row there is not
    where vLLM keeps its data and scales: the same check fails."""
    connector = generated.get("vllm_mla_latent", "kv_mla")()
    cache, fresh = engine.allocate(), engine.allocate()
    _fill(cache.backing)
    swa = next(g for g in MODEL.groups if g.name == "swa_even")
    leaves = [cache.kv[cache.names[i]] for i in swa.layers]
    slots = [s for s in _slot_mappings(engine, cache)["swa_even"] if s >= 0]
    obj = MemoryObj(torch.zeros(connector.get_shape(len(slots), leaves), dtype=torch.uint8))
    connector.from_gpu(obj, 0, len(slots), kvcaches=leaves, slot_mapping=torch.tensor(slots))
    connector.to_gpu(obj, 0, len(slots), kvcaches=[fresh.kv[cache.names[i]] for i in swa.layers],
                     slot_mapping=torch.tensor(slots))
    mask = _expected_mask(cache, {g.name: (slots if g.name == "swa_even" else []) for g in MODEL.groups})
    assert not torch.equal(fresh.backing[mask], cache.backing[mask])


def test_groups_that_overlay_are_read_as_such_and_one_groups_entries_never_share(engine: SimpleNamespace) -> None:
    """swa_even's and swa_odd's layers are the same bytes of the slab (the spec says `overlaid`);
    one group's entries given twice are still refused."""
    cache = engine.allocate()
    even, odd = (next(g for g in MODEL.groups if g.name == n) for n in ("swa_even", "swa_odd"))
    assert cache.kv[cache.names[even.layers[0]]].data_ptr() == cache.kv[cache.names[odd.layers[0]]].data_ptr()
    connector = generated.get_model("deepseek_v4_flash", "kv_groups")()
    connector.bind(cache.runner)
    twice = list(cache.runner)
    twice[even.layers[1]] = twice[even.layers[0]]
    with pytest.raises(KVLayoutError, match="are the same memory"):
        connector.bind(twice)


# -- the MXFP4 indexer keys (indexer_kv_dtype "mxfp4") -----------------------------------------------

#: DeepseekV4Indexer's MXFP4 k_cache_head_dim: 64 packed e2m1 bytes and 4 UE8M0 scales a token.
FP4_DATA, FP4_SCALES = 64, 4
FP4_LAYERS, FP4_TOKENS = 2, 96


@pytest.fixture(scope="module")
def fp4_indexer() -> Iterator[SimpleNamespace]:
    """Two layers of vLLM's DeepseekV4IndexerCache at the MXFP4 head_dim, grouped, planned and
    allocated by vLLM as the model's indexer keys are (one compressed group, 4 tokens a state)."""
    with pytest.MonkeyPatch.context() as mp:
        context = _Context()
        mp.setattr(f"{DSV4_ATTENTION}.get_current_vllm_config", lambda: context)
        mp.setattr(platforms.current_platform, "check_runner_kv_caches_multi_layer", lambda: None)
        vc = _vllm_config()
        index_head = DEEPSEEK_V4_FLASH["index_head_dim"]
        assert index_head // 2 + index_head // 32 == FP4_DATA + FP4_SCALES  # the size vLLM gives the cache
        caches = [dsv4_attention.DeepseekV4IndexerCache(head_dim=FP4_DATA + FP4_SCALES, dtype=torch.uint8,
                                                        prefix=f"model.layers.{i}.attn.indexer.k_cache",
                                                        cache_config=vc.cache_config, compress_ratio=4)
                  for i in range(FP4_LAYERS)]
        specs = {c.prefix: c.get_kv_cache_spec(vc) for c in caches}
        config = planning.get_kv_cache_config_from_groups(vc, planning.get_kv_cache_groups(vc, specs), 1 << 26)

        def allocate() -> SimpleNamespace:
            kv = worker.allocate_kv_cache(config, torch.device("cpu"), vllm_layouts.KVCacheLayout[LAYOUT])
            views = [kv[c.prefix] for c in caches]
            backing = torch.tensor([], dtype=torch.uint8).set_(views[0].untyped_storage())
            return SimpleNamespace(views=views, backing=backing)

        yield SimpleNamespace(allocate=allocate, state_tokens=specs[caches[0].prefix].tokens_per_state)


def _fp4_places(view: torch.Tensor, slot: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(start, stop) of a state's packed values and of its scales in the allocation, where the MXFP4
    writer puts them: n * 64 of its block, and N * 64 + n * 4."""
    n = view.shape[2]
    block, at = divmod(slot, n)
    start = view[block].data_ptr() - view.untyped_storage().data_ptr()
    return ((start + at * FP4_DATA, start + (at + 1) * FP4_DATA),
            (start + n * FP4_DATA + at * FP4_SCALES, start + n * FP4_DATA + (at + 1) * FP4_SCALES))


def test_mxfp4_indexer_keys_move_both_ways_at_the_writers_offsets(fp4_indexer: SimpleNamespace) -> None:
    cache, fresh = fp4_indexer.allocate(), fp4_indexer.allocate()
    n = cache.views[0].shape[2]
    assert fp4_indexer.state_tokens == 4 and cache.views[0].shape[1:] == (1, BLOCK_SIZE // 4, FP4_DATA + FP4_SCALES)
    _fill(cache.backing)
    slots = [-1 if s % 7 == 3 else n + (5 * s + 1) % (2 * n) for s in range(FP4_TOKENS)]  # blocks 1, 2; some -1
    connector = generated.get("vllm_dsv4_indexer_mxfp4", "kv_planes")()
    obj = MemoryObj(torch.zeros(connector.get_shape(FP4_TOKENS, cache.views), dtype=torch.uint8))
    connector.from_gpu(obj, 0, FP4_TOKENS, kvcaches=cache.views, slot_mapping=torch.tensor(slots))
    # the object: per layer every state's 64 value bytes, then (16-byte aligned) every state's 4 scales
    scale_at = -(-FP4_TOKENS * FP4_DATA // 16) * 16
    for layer, view in enumerate(cache.views):
        row = obj.tensor[layer]
        for t, slot in enumerate(slots):
            if slot < 0:
                continue
            (d0, d1), (s0, s1) = _fp4_places(view, slot)
            assert torch.equal(row[t * FP4_DATA:(t + 1) * FP4_DATA], cache.backing[d0:d1]), (layer, t)
            assert torch.equal(row[scale_at + t * FP4_SCALES:scale_at + (t + 1) * FP4_SCALES],
                               cache.backing[s0:s1]), (layer, t)
    connector.to_gpu(obj, 0, FP4_TOKENS, kvcaches=fresh.views, slot_mapping=torch.tensor(slots))
    mask = torch.zeros(cache.backing.numel(), dtype=torch.bool)
    for view in cache.views:
        for slot in (s for s in slots if s >= 0):
            for start, stop in _fp4_places(view, slot):
                mask[start:stop] = True
    assert torch.equal(fresh.backing[mask], cache.backing[mask])
    assert not fresh.backing[~mask].any()  # nothing else written


def test_mxfp4_indexer_pages_are_not_the_fp8_indexers(fp4_indexer: SimpleNamespace) -> None:
    """The fp8 indexer's rows are 132 bytes (128 values and an fp32 scale): its connector refuses
    the 68-byte pages before anything moves."""
    cache = fp4_indexer.allocate()
    connector = generated.get("vllm_dsv4_indexer", "kv_planes")()
    with pytest.raises(KVLayoutError, match="132"):
        connector.bind(cache.views)
