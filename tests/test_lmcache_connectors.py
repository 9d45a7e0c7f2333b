"""kvgen's LMCache connectors driven through LMCache's own objects (LMCacheMetadata,
MemoryFormat, PinMemoryAllocator memory objects), every built-in layout, whole and
layerwise, each store and each load checked bit for bit against kvgen's reference.

Caches carry the codes of their coordinates and objects codes of their positions, so a
K/V swap, a transposed head or a token in the wrong slot changes the compared bits.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from harness import builtin_library, need_lmcache

need_lmcache()

from lmcache.v1.memory_allocators.pin_memory_allocator import PinMemoryAllocator  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

import kvgen.integrations.lmcache as kl  # noqa: E402
from kvgen import generated  # noqa: E402
from kvgen.integrations.detect import detectable  # noqa: E402
from kvgen.oracle import reference  # noqa: E402
from kvgen.oracle.scenarios import EXT, block_table_mapping, clone_tree, make_cache, same_bits  # noqa: E402
from kvgen.runtime import KVLayoutError, MemoryObj  # noqa: E402

LIBRARY = builtin_library()
STARTS, ENDS = [4, 9, 19], [8, 13, 25]
SEQ = 25
#: How each engine hands a layout over, and the hint a deployment gives where the cache alone
#: cannot say: vLLM shows HND caches in its logical N-before-H order (a permuted view).
HANDED = {
    "vllm_flash_attn_hnd": ("logical", {}),
    "vllm_flashinfer_hnd": ("logical", {}),
    "vllm_flashinfer_nhd": ("as is", {"kv_layout": "NHD"}),  # [B, 2, N, H, C] with H == 2 is [B, H, N, 2, C] too
    "vllm_packed_hnd": ("as is", {"kv_layout": "HND"}),
    "vllm_packed_hnd_5d": ("as is", {"kv_layout": "HND"}),
    "vllm_heads_first": ("as is", {"kv_layout": "LHBNC"}),
    "vllm_blocks_first_hnd": ("as is", {"kv_layout": "BLHNC"}),
    "vllm_blocks_heads_first": ("as is", {"kv_layout": "BHLNC"}),
    "vllm_rbln": ("as is", {"kv_layout": "HND"}),
    # SGLang's pools name their layout (pool.kv_cache_layout); a 4-D buffer's shape never does.
    "sglang_mha_blocks": ("as is", {"kv_layout": "nhd"}),
    "sglang_mha_hnd": ("as is", {"kv_layout": "hnd"}),
}
#: The layouts LMCache's connector classes move: one tree of K/V or MLA tensors that pairs with
#: LMCache's objects (caches of several parts or fields are kvgen's own, taken by name), one slot a
#: token (LMCache's kv_shape counts tokens; a pooled encoder cache moves through from_vllm).
PAGED = [s.name for s in LIBRARY.paged if s.name != "trtllm_pool" and detectable(generated.LAYOUTS[s.name])
         and s.token_ratio == (1, 1)
         and any(o in ("kv_2ltd", "kv_mla") for (p, o) in generated.CONNECTORS if p == s.name)]


def _family(layout: str) -> str:
    return generated.LAYOUTS[layout]["engines"][0].split("/")[0].split("-")[0]


def _handed(layout: str, cache: Any) -> tuple[Any, dict[str, Any]]:
    how, hints = HANDED.get(layout, ("as is", {}))
    spec = LIBRARY[layout]
    if _family(layout) == "vllm" and spec.given:  # vLLM 0.33: the logical [B, H, N, C] and its KVCacheLayout
        order = [next(i for i, d in enumerate(spec.dims) if d == g) for g in spec.given]
        return [t.permute(*order) for t in cache], {"kv_layout": (spec.aliases or ("LBNHC",))[0],
                                                     "engine_version": "0.33.0"}
    if _family(layout) == "vllm":  # the releases before KVCacheLayout (not the installed vllm's)
        hints = {**hints, "engine_version": "0.32.0"}
    if how == "logical":  # swap the H and N dims of every tensor: what vLLM hands over
        spec = LIBRARY[layout]
        h = next(i for i, d in enumerate(spec.dims) if d.axes == ("H",))
        n = next(i for i, d in enumerate(spec.dims) if d.axes == ("N",))
        perm = list(range(len(spec.dims)))
        perm[h], perm[n] = n, h
        cache = [t.permute(*perm) for t in cache]
    return cache, hints


def _metadata(layout: str) -> LMCacheMetadata:
    mla = generated.LAYOUTS[layout]["planes"] == 1
    heads = 1 if mla else EXT["H"]
    return LMCacheMetadata(model_name="kvgen-test", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.float32, use_mla=mla,
                           kv_shape=(EXT["L"], 1 if mla else 2, 32, heads, EXT["C"]))


def _connector(layout: str, layerwise: bool, hints: dict[str, Any], use_gpu: bool) -> Any:
    family = _family(layout)
    cls = {("vllm", False): kl.VLLMPagedMemGPUConnectorV2, ("vllm", True): kl.VLLMPagedMemLayerwiseGPUConnector,
           ("sglang", False): kl.SGLangGPUConnector, ("sglang", True): kl.SGLangLayerwiseGPUConnector}[
        (family, layerwise)]
    return cls.from_metadata(_metadata(layout), use_gpu=use_gpu, device="cpu", layout_hints=hints)


def _fill(objs: list[Any], salt: int) -> None:
    reference.layouts.fill_object([o.tensor for o in objs], torch.float32, salt)


@pytest.fixture(scope="module")
def alloc():
    a = PinMemoryAllocator(size=8 * 1024 * 1024)
    yield a
    a.close()


@pytest.mark.parametrize("use_gpu", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("layout", PAGED)
def test_store_and_load_match_reference(layout: str, layerwise: bool, use_gpu: bool, alloc: Any) -> None:
    mla = generated.LAYOUTS[layout]["planes"] == 1
    if layerwise and _family(layout) == "sglang" and mla:
        pytest.skip("LMCache has no layerwise SGLang MLA connector")
    spec = LIBRARY[layout]
    obj_spec = LIBRARY[("kv_mla_layer" if mla else "kv_t2d") if layerwise else ("kv_mla" if mla else "kv_2ltd")]
    fmt = MemoryFormat[obj_spec.format]
    cache = make_cache(spec, torch.float32, "cpu")
    handed, hints = _handed(layout, cache)
    conn = _connector(layout, layerwise, hints, use_gpu)
    rng = random.Random(layout)
    mapping_list = block_table_mapping(SEQ, rng, EXT)
    mapping_list[5] = -1  # a token whose KV the engine does not hold
    mapping = torch.tensor(mapping_list)

    lengths = [e - s for s, e in zip(STARTS, ENDS, strict=True)]
    if layerwise:
        objs = [[alloc.allocate(conn.get_shape(n), torch.float32, MemoryFormat.UNDEFINED) for n in lengths]
                for _ in range(EXT["L"])]
        flat = [o for row in objs for o in row]
    else:
        objs = [alloc.allocate(conn.get_shape(n), torch.float32, MemoryFormat.UNDEFINED) for n in lengths]
        flat = objs
    _fill(flat, 7)
    want = [o.tensor.clone() for o in flat]
    try:
        if layerwise:
            gen = conn.batched_from_gpu(objs, STARTS, ENDS, kvcaches=handed, slot_mapping=mapping, sync=True,
                                        offset=2)
            assert sum(1 for _ in gen) == EXT["L"] + 1
            per_chunk = [[row[i].tensor for row in objs] for i in range(len(lengths))]
            want_chunks = [[want[layer * len(lengths) + i] for layer in range(EXT["L"])] for i in range(len(lengths))]
        else:
            conn.batched_from_gpu(objs, STARTS, ENDS, kvcaches=handed, slot_mapping=mapping, offset=2)
            per_chunk = [o.tensor for o in objs]
            want_chunks = want
        for chunk, s, e in zip(want_chunks, STARTS, ENDS, strict=True):
            reference.store(spec, obj_spec, EXT, cache, chunk, reference.Span(mapping_list, s, e))
        assert same_bits(per_chunk, want_chunks), f"{layout}: stored objects differ from the reference"
        assert {o.metadata.fmt for o in flat} == {fmt}
        assert conn.detection is not None and conn.detection.layout == layout

        # load fresh codes: vLLM skips the tokens the engine holds; SGLang passes a mapping from `offset` on
        _fill(flat, 11)
        target = clone_tree(cache)
        expected = clone_tree(cache)
        handed_target, _ = _handed(layout, target)
        kwargs: dict[str, Any] = {"kvcaches": handed_target}
        skips = [0, 0, 0]
        if _family(layout) == "sglang":
            kwargs.update(slot_mapping=mapping[4:], offset=4)
        else:
            kwargs.update(slot_mapping=mapping, vllm_cached_tokens=6)
            skips = [min(e - s, max(0, 6 - s)) for s, e in zip(STARTS, ENDS, strict=True)]
        if layerwise:
            gen = conn.batched_to_gpu(STARTS, ENDS, sync=True, **kwargs)
            next(gen)
            for row in objs:
                gen.send(row)
            next(gen)
            with pytest.raises(StopIteration):
                next(gen)
        else:
            conn.batched_to_gpu(objs, STARTS, ENDS, **kwargs)
        for chunk, s, e, skip in zip(per_chunk, STARTS, ENDS, skips, strict=True):
            reference.load(spec, obj_spec, EXT, expected, chunk, reference.Span(mapping_list, s, e, 0,
                           skip))
        assert same_bits(target, expected), f"{layout}: loaded cache differs from the reference"
        assert not same_bits(target, cache), "the load wrote nothing"
    finally:
        for o in flat:
            o.ref_count_down()


def test_an_sglang_4d_pool_without_layout_hints_is_refused_naming_the_pools_word(alloc: Any) -> None:
    cache = make_cache(LIBRARY["sglang_mha_hnd"], torch.float32, "cpu")  # [pages, H, page, C] K and V lists
    conn = _connector("sglang_mha_hnd", False, {}, False)
    obj = alloc.allocate(conn.get_shape(4), torch.float32, MemoryFormat.UNDEFINED)
    try:
        with pytest.raises(KVLayoutError, match="kv_cache_layout"):
            conn.batched_from_gpu([obj], [0], [4], kvcaches=cache, slot_mapping=torch.arange(4), offset=0)
    finally:
        obj.ref_count_down()


def test_trtllm_pool_by_block_ids(alloc: Any) -> None:
    """TensorRT-LLM: the 4-D pool registered once, chunks addressed by block ids."""
    spec = LIBRARY["trtllm_pool"]
    pool6 = make_cache(spec, torch.float32, "cpu")  # [B L KV H N C], coded
    pool = pool6.flatten(3)  # what TensorRT-LLM registers: [B, L, 2, H*N*C]
    meta = LMCacheMetadata(model_name="t", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.float32, kv_shape=(EXT["L"], 2, 2 * EXT["N"], EXT["H"], EXT["C"]))
    conn = kl.TRTLLMGPUConnector.from_metadata(meta, device="cpu")
    conn.register_kv_caches(pool)
    assert conn.detection is not None and conn.detection.layout == "trtllm_pool"
    block_ids = [7, 2, 9, 4, 11]  # chunk 0: blocks 7, 2; chunk 1: 9, 4; chunk 2 lacks its second block
    n = 2 * EXT["N"]
    objs = [alloc.allocate(conn.get_shape(n), torch.float32, MemoryFormat.KV_2LTD) for _ in range(3)]
    try:
        _fill(objs, 3)
        untouched = objs[2].tensor.clone()
        conn.batched_from_gpu(objs, [0, n, 2 * n], [n, 2 * n, 3 * n], block_ids=block_ids)
        slots = [b * EXT["N"] + i for b in block_ids for i in range(EXT["N"])]
        for k, obj in enumerate(objs[:2]):
            want = torch.zeros_like(obj.tensor)
            reference.store(spec, LIBRARY["kv_2ltd"], EXT, pool6, want, reference.Span(slots, k * n, (k + 1) * n))
            assert same_bits(obj.tensor, want)
        assert same_bits(objs[2].tensor, untouched), "a chunk without all its blocks must be left alone"

        target = torch.zeros_like(pool)
        conn.register_kv_caches(target)
        expected = torch.zeros_like(pool6)
        conn.to_gpu(objs[1], n, 2 * n, block_ids=block_ids)
        reference.load(spec, LIBRARY["kv_2ltd"], EXT, expected, objs[1].tensor, reference.Span(slots, n, 2 * n))
        assert same_bits(target, expected.flatten(3))
    finally:
        for o in objs:
            o.ref_count_down()


def _trtllm(pool: torch.Tensor) -> Any:
    meta = LMCacheMetadata(model_name="t", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.float32, kv_shape=(EXT["L"], 2, 2 * EXT["N"], EXT["H"], EXT["C"]))
    conn = kl.TRTLLMGPUConnector.from_metadata(meta, device="cpu")
    conn.register_kv_caches(pool)
    return conn


@pytest.mark.parametrize(("bad", "refusal"), [
    (2**62 + 3, r"block_ids\[1\] = 4611686018427387907 is not a block of the pool \(0 to 11\)"),  # wraps in int64
    (-1, r"block_ids\[1\] = -1 is not a block of the pool \(0 to 11\)"),
    (EXT["B"], r"block_ids\[1\] = 12 is not a block of the pool \(0 to 11\)"),  # one past the pool
    (3.7, r"block_ids\[1\] must be an integer, got float 3.7"),
    (3.0, r"block_ids\[1\] must be an integer, got float 3.0"),
    ("3", r"block_ids\[1\] must be an integer, got str '3'"),
    (True, r"block_ids\[1\] must be an integer, got True"),
], ids=["wraps_in_int64", "minus_one", "one_past_the_pool", "fraction", "float", "text", "bool"])
@pytest.mark.parametrize("direction", ["store", "load"])
def test_trtllm_block_ids_that_are_no_block_are_refused(bad: Any, refusal: str, direction: str) -> None:
    """A block id the pool does not have, or no integer, is refused by its own name before
    anything moves (it once wrapped, was truncated, or skipped half a chunk)."""
    pool = make_cache(LIBRARY["trtllm_pool"], torch.float32, "cpu").flatten(3)
    conn = _trtllm(pool)
    n = 2 * EXT["N"]
    objs = [kl_obj(conn, n, k) for k in range(2)]
    before = [pool.clone(), *(o.tensor.clone() for o in objs)]
    block_ids = [7, bad, 9, 4]
    move = conn.batched_from_gpu if direction == "store" else conn.batched_to_gpu
    with pytest.raises(KVLayoutError, match=refusal):
        move(objs, [0, n], [n, 2 * n], block_ids=block_ids)
    assert all(same_bits(a, b) for a, b in zip([pool, *(o.tensor for o in objs)], before, strict=True))


def test_trtllm_block_ids_as_a_tensor() -> None:
    """An integer tensor of block ids moves the blocks it names (a float tensor is refused)."""
    spec = LIBRARY["trtllm_pool"]
    pool6 = make_cache(spec, torch.float32, "cpu")
    conn = _trtllm(pool6.flatten(3))
    n = 2 * EXT["N"]
    obj = kl_obj(conn, n, 0)
    conn.from_gpu(obj, 0, n, block_ids=torch.tensor([5, 1]))
    want = torch.zeros_like(obj.tensor)
    slots = [b * EXT["N"] + i for b in (5, 1) for i in range(EXT["N"])]
    reference.store(spec, LIBRARY["kv_2ltd"], EXT, pool6, want, reference.Span(slots, 0, n))
    assert same_bits(obj.tensor, want)
    with pytest.raises(KVLayoutError, match="block_ids must be a list of integers"):
        conn.from_gpu(obj, 0, n, block_ids=torch.tensor([5.0, 1.0]))


def kl_obj(conn: Any, tokens: int, salt: int) -> Any:
    t = torch.zeros(conn.get_shape(tokens), dtype=torch.float32)
    reference.layouts.fill_object([t], torch.float32, 100 + salt)
    return MemoryObj(t, MemoryFormat.KV_2LTD)


def test_lmcache_isinstance_checks_accept_kvgen() -> None:
    from lmcache.v1.gpu_connector import gpu_connectors, xpu_connectors
    from lmcache.v1.gpu_connector.utils import assert_layerwise_gpu_connector

    conn = kl.VLLMPagedMemLayerwiseXPUConnector(64, 2)
    assert isinstance(conn, gpu_connectors.GPUConnectorInterface)
    assert isinstance(conn, xpu_connectors.VLLMPagedMemLayerwiseXPUConnector)
    assert_layerwise_gpu_connector(conn)
    assert isinstance(kl.SGLangGPUConnector(64, 2), gpu_connectors.SGLangGPUConnector)
