"""The LMCache contract around the copies: constructors and signatures, the factory,
memory objects (LMCache's and kvgen's), keyword-argument translation, the staging
allocator, and refusals before any write."""

from __future__ import annotations

import inspect
import random
from typing import Any

import pytest
import torch
from harness import builtin_library, need_lmcache

need_lmcache()

from lmcache.utils import EngineType  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.gpu_connector import CreateGPUConnector, gpu_connectors, xpu_connectors  # noqa: E402
from lmcache.v1.memory_allocators.pin_memory_allocator import PinMemoryAllocator  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

import kvgen.integrations.lmcache as kl  # noqa: E402
from kvgen.integrations import hints as kvgen_hints  # noqa: E402
from kvgen.integrations.lmcache.base import LayerBufferAllocator, call_with  # noqa: E402
from kvgen.oracle import reference  # noqa: E402
from kvgen.oracle.scenarios import EXT, block_table_mapping, clone_tree, make_cache, same_bits  # noqa: E402
from kvgen.runtime import KVLayoutError, MemoryObj  # noqa: E402


@pytest.fixture(autouse=True)
def _vllm_before_kv_cache_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """These caches are the [2, B, N, H, C] tensors vLLM handed over before 0.33, whatever vllm
    is installed here (detection reads the installed release otherwise)."""
    monkeypatch.setattr(kvgen_hints, "installed_version", lambda engine: "0.32.0" if engine == "vllm" else None)


LIBRARY = builtin_library()
NHD = LIBRARY["vllm_flash_attn_nhd"]
CLASSES = [("gpu_connectors", n) for n in ("VLLMPagedMemGPUConnectorV2", "VLLMPagedMemGPUConnectorV3",
                                           "VLLMPagedMemLayerwiseGPUConnector", "SGLangGPUConnector",
                                           "SGLangLayerwiseGPUConnector", "TRTLLMGPUConnector")]
CLASSES += [("xpu_connectors", n) for n in ("VLLMPagedMemXPUConnectorV2", "VLLMPagedMemXPUConnectorV3",
                                            "VLLMPagedMemLayerwiseXPUConnector", "SGLangXPUConnector",
                                            "SGLangLayerwiseXPUConnector")]


def _meta(**kw: Any) -> LMCacheMetadata:
    args = dict(model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                kv_dtype=torch.float32, kv_shape=(EXT["L"], 2, 16, EXT["H"], EXT["C"]))
    args.update(kw)
    return LMCacheMetadata(**args)


def _names(fn: Any) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]


@pytest.mark.parametrize(("module", "name"), CLASSES)
def test_same_names_constructors_and_methods_as_lmcache(module: str, name: str) -> None:
    theirs = getattr({"gpu_connectors": gpu_connectors, "xpu_connectors": xpu_connectors}[module], name)
    ours = getattr(kl, name)
    assert _names(ours.__init__) == _names(theirs.__init__)
    # from_metadata: LMCache's parameters first and in order; kvgen's extra ones after them
    # (LMCache's SGLang connectors have none; kvgen's take the same as the vLLM ones)
    if hasattr(theirs, "from_metadata"):
        assert _names(ours.from_metadata)[:len(_names(theirs.from_metadata))] == _names(theirs.from_metadata)
    else:
        assert _names(ours.from_metadata) == ["metadata", "use_gpu", "device", "layout_hints"]
    for method in ("to_gpu", "from_gpu", "batched_from_gpu", "batched_to_gpu", "get_shape"):
        assert _names(getattr(ours, method)) == _names(getattr(theirs, method)), method
    assert issubclass(ours, gpu_connectors.GPUConnectorInterface)
    assert issubclass(ours, theirs)  # virtual: LMCache's isinstance checks accept kvgen's


def test_create_gpu_connector_has_lmcache_signature_and_picks_like_it() -> None:
    assert _names(kl.create_gpu_connector) == _names(CreateGPUConnector)
    meta = _meta()
    picks = {
        (EngineType.VLLM, ()): kl.VLLMPagedMemGPUConnectorV2,
        (EngineType.VLLM, (("use_layerwise", True),)): kl.VLLMPagedMemLayerwiseGPUConnector,
        (EngineType.SGLANG, ()): kl.SGLangGPUConnector,
        (EngineType.SGLANG, (("use_layerwise", True),)): kl.SGLangLayerwiseGPUConnector,
        (EngineType.TRTLLM, ()): kl.TRTLLMGPUConnector,
    }
    for (engine, settings), cls in picks.items():
        conn = kl.create_gpu_connector(LMCacheEngineConfig.from_defaults(**dict(settings)), meta, engine)
        assert type(conn) is cls
        assert conn.device == torch.device("cpu") and conn.num_layers == EXT["L"]
    pd = kl.create_gpu_connector(LMCacheEngineConfig.from_defaults(enable_pd=True), meta, "vllm")
    assert pd.use_gpu is False
    assert kl.create_gpu_connector(LMCacheEngineConfig.from_defaults(), meta, "vllm").use_gpu is True
    with pytest.raises(KVLayoutError, match="no kvgen connector for engine 'atom'"):
        kl.create_gpu_connector(LMCacheEngineConfig.from_defaults(), meta, EngineType.ATOM)


def _vllm_store(conn: Any, cache: Any, objs: list[Any], mapping: torch.Tensor, **kw: Any) -> None:
    conn.batched_from_gpu(objs, [0, 8], [6, 14], kvcaches=cache, slot_mapping=mapping, **kw)


def test_kvgen_memory_objects_and_lmcache_labels_by_name() -> None:
    cache = make_cache(NHD, torch.float32, "cpu")
    mapping_list = block_table_mapping(14, random.Random(1), EXT)
    mapping = torch.tensor(mapping_list)
    conn = kl.VLLMPagedMemGPUConnectorV2.from_metadata(_meta(), device="cpu")
    ours = [MemoryObj(torch.zeros(conn.get_shape(6))) for _ in range(2)]  # kvgen's own, label None
    alloc = PinMemoryAllocator(size=1 << 20)
    theirs = [alloc.allocate(conn.get_shape(6), torch.float32, MemoryFormat.KV_2LTD) for _ in range(2)]
    try:
        _vllm_store(conn, cache, ours, mapping)
        _vllm_store(conn, cache, theirs, mapping, offset=3, req_id="r", request_configs=None, transfer_spec=None)
        assert same_bits([o.tensor for o in ours], [o.tensor for o in theirs])
        assert all(o.metadata.fmt.name == "KV_2LTD" for o in ours)
        assert all(o.metadata.fmt is MemoryFormat.KV_2LTD for o in theirs)  # LMCache's own enum member
        want = torch.zeros(conn.get_shape(6))
        reference.store(NHD, LIBRARY["kv_2ltd"], EXT, cache, want, reference.Span(mapping_list, 8, 14))
        assert same_bits(theirs[1].tensor, want)

        theirs[0].metadata.fmt = MemoryFormat.KV_T2D
        before = clone_tree(cache)
        with pytest.raises(KVLayoutError, match="labelled KV_T2D"):
            conn.batched_to_gpu(theirs, [0, 8], [6, 14], kvcaches=cache, slot_mapping=mapping)
        assert same_bits(cache, before)
        theirs[0].ref_count_down()
        with pytest.raises(KVLayoutError, match="freed"):
            conn.to_gpu(theirs[0], 0, 6, kvcaches=cache, slot_mapping=mapping)
        assert same_bits(cache, before)
    finally:
        theirs[1].ref_count_down()
        alloc.close()


def test_lmcache_keyword_errors_are_lmcache_s() -> None:
    cache = make_cache(NHD, torch.float32, "cpu")
    conn = kl.VLLMPagedMemGPUConnectorV2.from_metadata(_meta(), device="cpu")
    obj = MemoryObj(torch.zeros(conn.get_shape(4)))
    with pytest.raises(ValueError, match="'slot_mapping' should be provided"):
        conn.from_gpu(obj, 0, 4, kvcaches=cache)
    fresh = kl.VLLMPagedMemGPUConnectorV2.from_metadata(_meta(), device="cpu")
    with pytest.raises(ValueError, match="'kvcaches' should be provided"):
        fresh.from_gpu(obj, 0, 4, slot_mapping=torch.arange(4))
    lw = kl.VLLMPagedMemLayerwiseGPUConnector.from_metadata(_meta(), device="cpu")
    gen = lw.batched_from_gpu([[obj]] * EXT["L"], [0], [4], kvcaches=cache, slot_mapping=torch.arange(4))
    with pytest.raises(ValueError, match="'sync' should be provided"):
        next(gen)


def test_only_the_keywords_a_connector_names_are_passed() -> None:
    seen: dict[str, Any] = {}

    def strict(objs: Any, *, kvcaches: Any, slot_mapping: Any, offset: int = 0) -> None:
        seen.update(kvcaches=kvcaches, slot_mapping=slot_mapping, offset=offset)

    call_with(strict, [], kvcaches=1, slot_mapping=2, offset=3, skip_prefix_n_tokens=0)
    assert seen == {"kvcaches": 1, "slot_mapping": 2, "offset": 3}
    with pytest.raises(KVLayoutError, match="takes no skip_prefix_n_tokens"):
        call_with(strict, [], kvcaches=1, slot_mapping=2, skip_prefix_n_tokens=4)


@pytest.mark.parametrize("use_gpu", [False, True])
def test_gpu_buffer_allocator_follows_lmcache(use_gpu: bool) -> None:
    cache = make_cache(NHD, torch.float32, "cpu")
    conn = kl.VLLMPagedMemLayerwiseGPUConnector.from_metadata(_meta(), use_gpu=use_gpu, device="cpu")
    assert conn.gpu_buffer_allocator is None
    objs = [[MemoryObj(torch.zeros(conn.get_shape(5)))] for _ in range(EXT["L"])]
    for _ in conn.batched_from_gpu(objs, [0], [5], kvcaches=cache, slot_mapping=torch.arange(5), sync=True):
        pass
    if not use_gpu:
        assert conn.gpu_buffer_allocator is None
        return
    alloc = conn.gpu_buffer_allocator
    layer_bytes = cache[0].numel() * cache[0].element_size()
    assert isinstance(alloc, LayerBufferAllocator) and alloc.size == layer_bytes
    assert conn.tokens_per_layer == EXT["B"] * EXT["N"]
    half = torch.Size([layer_bytes // 8])  # float32: a quarter of... half the buffer each
    a = alloc.allocate(half, torch.float32, MemoryFormat.KV_T2D)
    b = alloc.allocate(half, torch.float32, MemoryFormat.KV_T2D)
    assert a is not None and b is not None and alloc.allocate(half, torch.float32) is None
    assert a.tensor.data_ptr() != b.tensor.data_ptr() and a.metadata.fmt is MemoryFormat.KV_T2D
    a.ref_count_down()
    assert not a.is_valid() and alloc.allocate(half, torch.float32) is not None


def test_v3_and_layer_groups() -> None:
    cache = make_cache(NHD, torch.float32, "cpu")
    mapping_list = block_table_mapping(9, random.Random(3), EXT)
    conn = kl.VLLMPagedMemGPUConnectorV3.from_metadata(_meta(), use_gpu=True, device="cpu")
    assert conn.init is False
    obj = MemoryObj(torch.zeros(conn.get_shape(9)))
    conn.from_gpu(obj, 0, 9, kvcaches=cache, slot_mapping=torch.tensor(mapping_list))
    want = torch.zeros(conn.get_shape(9))
    reference.store(NHD, LIBRARY["kv_2ltd"], EXT, cache, want, reference.Span(mapping_list, 0, 9))
    assert conn.init is True and same_bits(obj.tensor, want)

    class Groups:
        kernel_groups = [object(), object()]

    with pytest.raises(KVLayoutError, match="2 layer groups"):
        kl.VLLMPagedMemGPUConnectorV3(_meta(kv_layer_groups_manager=Groups()), "cpu")


def test_mla_layerwise_without_staging_and_tuples_with_it() -> None:
    """Where LMCache's own code fails: layerwise MLA without staging, (K, V) tuples layerwise
    with staging and whole-chunk."""
    for layout, use_gpu, layerwise in (("vllm_mla", False, True), ("vllm_kv_tuple", True, True),
                                       ("vllm_kv_tuple", False, False)):
        spec = LIBRARY[layout]
        mla = layout == "vllm_mla"
        meta = _meta(use_mla=mla, kv_shape=(EXT["L"], 1 if mla else 2, 16, 1 if mla else EXT["H"], EXT["C"]))
        cls = kl.VLLMPagedMemLayerwiseGPUConnector if layerwise else kl.VLLMPagedMemGPUConnectorV2
        conn = cls.from_metadata(meta, use_gpu=use_gpu, device="cpu")
        cache = make_cache(spec, torch.float32, "cpu")
        mapping_list = block_table_mapping(7, random.Random(layout), EXT)
        mapping = torch.tensor(mapping_list)
        if layerwise:
            objs = [[MemoryObj(torch.zeros(conn.get_shape(7)))] for _ in range(EXT["L"])]
            assert sum(1 for _ in conn.batched_from_gpu(objs, [0], [7], kvcaches=cache, slot_mapping=mapping,
                                                        sync=True)) == EXT["L"] + 1
            got = [row[0].tensor for row in objs]
            want = [torch.zeros(conn.get_shape(7)) for _ in range(EXT["L"])]
            obj_spec = LIBRARY["kv_mla_layer" if mla else "kv_t2d"]
        else:
            obj = MemoryObj(torch.zeros(conn.get_shape(7)))
            conn.from_gpu(obj, 0, 7, kvcaches=cache, slot_mapping=mapping)
            got, want, obj_spec = obj.tensor, torch.zeros(conn.get_shape(7)), LIBRARY["kv_2ltd"]
        reference.store(spec, obj_spec, EXT, cache, want, reference.Span(mapping_list, 0, 7))
        assert same_bits(got, want), layout


MLA = LIBRARY["vllm_mla"]
MLA_META = {"use_mla": True, "kv_shape": (EXT["L"], 1, 16, 1, EXT["C"])}


def test_mla_stores_relabel_lmcache_s_default_allocation_label() -> None:
    """LMCache allocates whole-chunk objects as KV_2LTD and its MLA store relabels them
    KV_MLA_FMT; kvgen's drop-in does the same, and still refuses a wrong object unchanged."""
    cache = make_cache(MLA, torch.float32, "cpu")
    mapping_list = block_table_mapping(14, random.Random(13), EXT)
    mapping = torch.tensor(mapping_list)
    conn = kl.VLLMPagedMemGPUConnectorV2.from_metadata(_meta(**MLA_META), device="cpu")
    alloc = PinMemoryAllocator(size=1 << 20)
    objs = [alloc.allocate(conn.get_shape(6), torch.float32, MemoryFormat.KV_2LTD) for _ in range(2)]
    wrong = alloc.allocate(conn.get_shape(5), torch.float32, MemoryFormat.KV_2LTD)
    try:
        _vllm_store(conn, cache, objs, mapping)
        assert all(o.metadata.fmt is MemoryFormat.KV_MLA_FMT for o in objs)
        for obj, (start, end) in zip(objs, [(0, 6), (8, 14)], strict=True):
            want = torch.zeros(conn.get_shape(6))
            reference.store(MLA, LIBRARY["kv_mla"], EXT, cache, want, reference.Span(mapping_list, start, end))
            assert same_bits(obj.tensor, want)
        before = wrong.tensor.clone()
        with pytest.raises(KVLayoutError, match="memory object"):
            conn.from_gpu(wrong, 0, 6, kvcaches=cache, slot_mapping=mapping)
        assert wrong.metadata.fmt is MemoryFormat.KV_2LTD and same_bits(wrong.tensor, before)
        for label in (MemoryFormat.KV_2TD, MemoryFormat.BINARY):  # labels of other kinds of data
            objs[0].metadata.fmt = label
            with pytest.raises(KVLayoutError, match=f"labelled {label.name}"):
                conn.from_gpu(objs[0], 0, 6, kvcaches=cache, slot_mapping=mapping)
            assert objs[0].metadata.fmt is label
    finally:
        for obj in [*objs, wrong]:
            obj.ref_count_down()
        alloc.close()


@pytest.mark.parametrize("cached", [2.9, "3", True, -1, None])
def test_vllm_cached_tokens_must_be_a_whole_count(cached: Any) -> None:
    cache = make_cache(NHD, torch.float32, "cpu")
    conn = kl.VLLMPagedMemGPUConnectorV2.from_metadata(_meta(), device="cpu")
    obj = MemoryObj(torch.zeros(conn.get_shape(6)))
    mapping = torch.tensor(block_table_mapping(6, random.Random(9), EXT))
    conn.from_gpu(obj, 0, 6, kvcaches=cache, slot_mapping=mapping)
    before = clone_tree(cache)
    if cached is None:  # LMCache's default: no cached tokens
        conn.to_gpu(obj, 0, 6, kvcaches=cache, slot_mapping=mapping, vllm_cached_tokens=None)
        return
    with pytest.raises(KVLayoutError, match=f"vllm_cached_tokens must be a whole number >= 0, got {cached!r}"):
        conn.to_gpu(obj, 0, 6, kvcaches=cache, slot_mapping=mapping, vllm_cached_tokens=cached)
    assert same_bits(cache, before)
    lw = kl.VLLMPagedMemLayerwiseGPUConnector.from_metadata(_meta(), device="cpu")
    with pytest.raises(KVLayoutError, match="vllm_cached_tokens must be a whole number"):
        next(lw.batched_to_gpu([0], [6], kvcaches=cache, slot_mapping=mapping, sync=True,
                               vllm_cached_tokens=cached))


def test_staging_allocator_memcheck_follows_its_accounting() -> None:
    """LMCache's connector tests call gpu_buffer_allocator.memcheck() after transfers."""
    alloc = LayerBufferAllocator(4096, "cpu")
    assert alloc.memcheck() is True
    a = alloc.allocate(torch.Size([64]), torch.float32)
    b = alloc.allocate(torch.Size([64]), torch.float32)
    assert a is not None and b is not None and alloc.memcheck() is True
    a.ref_count_down()
    assert alloc.memcheck() is True
    alloc._taken[b.tensor.data_ptr() - alloc._buffer.data_ptr() + 8] = 16  # an overlap: the books are wrong
    assert alloc.memcheck() is False
    cache = make_cache(NHD, torch.float32, "cpu")
    conn = kl.VLLMPagedMemLayerwiseGPUConnector.from_metadata(_meta(), use_gpu=True, device="cpu")
    objs = [[MemoryObj(torch.zeros(conn.get_shape(5)))] for _ in range(EXT["L"])]
    for _ in conn.batched_from_gpu(objs, [0], [5], kvcaches=cache, slot_mapping=torch.arange(5), sync=True):
        pass
    assert conn.gpu_buffer_allocator.memcheck() is True


@pytest.mark.parametrize("flag", ["use_gpu_connector_v3", "enable_blending"])
def test_cpu_refuses_the_vllm_features_lmcache_refuses_there(flag: str) -> None:
    config = LMCacheEngineConfig.from_defaults(**{flag: True})
    with pytest.raises(ValueError, match=f"config.{flag}=True is only supported on cuda/xpu") as theirs:
        CreateGPUConnector(config, _meta(), EngineType.VLLM)
    with pytest.raises(KVLayoutError, match=f"config.{flag}=True is only supported on cuda/xpu") as ours:
        kl.create_gpu_connector(config, _meta(), EngineType.VLLM)
    assert "device is 'cpu'" in str(theirs.value) and "device is 'cpu'" in str(ours.value)
