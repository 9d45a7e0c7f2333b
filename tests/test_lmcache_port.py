"""LMCache's own connector round-trip tests (tests/v1/test_xpu_connector.py of LMCache),
run against kvgen.integrations.lmcache on the CPU.

Only two things differ from LMCache's file: the connectors are imported from
kvgen.integrations.lmcache, and the device is "cpu" instead of "xpu:0". Every call into
the connectors (from_metadata, from_gpu, to_gpu, batched_from_gpu, batched_to_gpu, the
generator protocol, gpu_buffer_allocator) is LMCache's; the cache helpers are written here
(LMCache keeps its helpers in tests/v1/utils.py, which is not in its wheel) and compare
K and V of every stored slot of every layer exactly.
"""

from __future__ import annotations

import pytest
import torch
from harness import need_lmcache

need_lmcache()

from lmcache.v1.memory_allocators.pin_memory_allocator import PinMemoryAllocator  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

from kvgen.integrations import hints as kvgen_hints  # noqa: E402
from kvgen.integrations.lmcache import (  # noqa: E402
    VLLMPagedMemLayerwiseXPUConnector,
    VLLMPagedMemXPUConnectorV2,
)


@pytest.fixture(autouse=True)
def _vllm_before_kv_cache_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """These caches are the [2, B, N, H, C] tensors vLLM handed over before 0.33, whatever vllm
    is installed here (detection reads the installed release otherwise)."""
    monkeypatch.setattr(kvgen_hints, "installed_version", lambda engine: "0.32.0" if engine == "vllm" else None)


DEVICE = "cpu"


def generate_kv_cache_paged_list_tensors(num_blocks: int, block_size: int, num_layers: int, head_size: int,
                                         device: torch.device, num_heads: int = 8) -> list[torch.Tensor]:
    """vLLM FlashAttention caches, one [2, B, N, H, C] bf16 tensor per layer, random values."""
    gen = torch.Generator().manual_seed(num_blocks * 1000 + block_size * 10 + num_layers)
    return [torch.rand((2, num_blocks, block_size, num_heads, head_size), generator=gen,
                       dtype=torch.float32).to(torch.bfloat16).to(device) for _ in range(num_layers)]


def check_paged_kv_cache_equal(expected: list[torch.Tensor], actual: list[torch.Tensor],
                               slot_mapping: torch.Tensor, num_heads: int, head_size: int) -> None:
    """K and V of every slot in `slot_mapping`, every layer, bit for bit; and nothing else
    written (the destination started zeroed)."""
    block_size = expected[0].shape[2]
    slots = slot_mapping.cpu().long()
    blocks, offsets = slots // block_size, slots % block_size
    for src, dst in zip(expected, actual, strict=True):
        assert dst.shape[-2:] == (num_heads, head_size)
        assert torch.equal(src[:, blocks, offsets], dst[:, blocks, offsets])
        untouched = dst.clone()
        untouched[:, blocks, offsets] = 0
        assert not untouched.any()


def _skip_if_no_xpu() -> None:
    """LMCache skips without an XPU; here the CPU stands in for it."""


def _make_unique_slot_mapping(*, total_slots: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    return torch.randperm(total_slots, device=device, dtype=torch.int64)[:num_tokens]


def _pack_slot_mapping(slot_mapping: torch.Tensor, starts: list[int], ends: list[int]) -> torch.Tensor:
    return torch.cat([slot_mapping[s:e] for s, e in zip(starts, ends, strict=False)], dim=0)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize("use_gpu", [False, True])
def test_xpu_connector_roundtrip_non_layerwise(use_gpu: bool) -> None:
    _skip_if_no_xpu()
    device = torch.device(DEVICE)
    num_layers, num_blocks, block_size, head_size, num_tokens = 2, 4, 16, 64, 32
    kvcaches = generate_kv_cache_paged_list_tensors(num_blocks=num_blocks, block_size=block_size,
                                                    num_layers=num_layers, head_size=head_size, device=device)
    _, _, num_heads_actual, head_size_actual = kvcaches[0][0].shape
    hidden_dim_actual = num_heads_actual * head_size_actual
    slot_mapping = _make_unique_slot_mapping(total_slots=num_blocks * block_size, num_tokens=num_tokens,
                                             device=device)
    pin_alloc = PinMemoryAllocator(size=1024 * 1024 * 64)
    memobj = pin_alloc.allocate(torch.Size([2, num_layers, num_tokens, hidden_dim_actual]), torch.bfloat16,
                                MemoryFormat.KV_2LTD)
    meta = LMCacheMetadata(model_name="xpu_test", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16,
                           kv_shape=(num_layers, 2, num_tokens, num_heads_actual, head_size_actual))
    conn = VLLMPagedMemXPUConnectorV2.from_metadata(meta, use_gpu=use_gpu, device=device)
    try:
        conn.from_gpu(memobj, start=0, end=num_tokens, slot_mapping=slot_mapping, kvcaches=kvcaches)
        kvcaches_dst = generate_kv_cache_paged_list_tensors(num_blocks=num_blocks, block_size=block_size,
                                                            num_layers=num_layers, head_size=head_size_actual,
                                                            device=device)
        for t in kvcaches_dst:
            t.zero_()
        conn.to_gpu(memobj, start=0, end=num_tokens, slot_mapping=slot_mapping, kvcaches=kvcaches_dst)
        check_paged_kv_cache_equal(kvcaches, kvcaches_dst, slot_mapping, num_heads=num_heads_actual,
                                   head_size=head_size_actual)
    finally:
        memobj.ref_count_down()
        pin_alloc.close()


@pytest.mark.parametrize("use_gpu", [False, True])
def test_xpu_connector_roundtrip_layerwise(use_gpu: bool) -> None:
    _skip_if_no_xpu()
    device = torch.device(DEVICE)
    num_layers, num_blocks, block_size, head_size, num_tokens = 4, 8, 16, 64, 64
    kvcaches = generate_kv_cache_paged_list_tensors(num_blocks=num_blocks, block_size=block_size,
                                                    num_layers=num_layers, head_size=head_size, device=device)
    _, _, num_heads_actual, head_size_actual = kvcaches[0][0].shape
    hidden_dim_actual = num_heads_actual * head_size_actual
    slot_mapping = _make_unique_slot_mapping(total_slots=num_blocks * block_size, num_tokens=num_tokens,
                                             device=device)
    meta = LMCacheMetadata(model_name="xpu_test_layerwise", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16,
                           kv_shape=(num_layers, 2, num_tokens, num_heads_actual, head_size_actual))
    conn = VLLMPagedMemLayerwiseXPUConnector.from_metadata(meta, use_gpu=use_gpu, device=device)
    pin_alloc = PinMemoryAllocator(size=1024 * 1024 * 256)
    memobjs_by_layer = [[pin_alloc.allocate(torch.Size([num_tokens, 2, hidden_dim_actual]), torch.bfloat16,
                                            MemoryFormat.KV_T2D)] for _ in range(num_layers)]
    try:
        gen = conn.batched_from_gpu(memobjs_by_layer, starts=[0], ends=[num_tokens], slot_mapping=slot_mapping,
                                    sync=True, kvcaches=kvcaches)
        for _ in range(num_layers + 1):
            next(gen)
        kvcaches_dst = generate_kv_cache_paged_list_tensors(num_blocks=num_blocks, block_size=block_size,
                                                            num_layers=num_layers, head_size=head_size_actual,
                                                            device=device)
        for t in kvcaches_dst:
            t.zero_()
        gen2 = conn.batched_to_gpu(starts=[0], ends=[num_tokens], slot_mapping=slot_mapping, sync=True,
                                   kvcaches=kvcaches_dst)
        next(gen2)
        for layer_id in range(num_layers):
            gen2.send(memobjs_by_layer[layer_id])
        next(gen2)
        check_paged_kv_cache_equal(kvcaches, kvcaches_dst, slot_mapping, num_heads=num_heads_actual,
                                   head_size=head_size_actual)
    finally:
        for layer in memobjs_by_layer:
            for m in layer:
                m.ref_count_down()
        pin_alloc.close()


@pytest.mark.parametrize("use_gpu", [False, True])
def test_xpu_connector_roundtrip_non_layerwise_multi_chunk(use_gpu: bool) -> None:
    _skip_if_no_xpu()
    device = torch.device(DEVICE)
    num_layers, num_blocks, block_size, head_size, total_tokens = 2, 6, 8, 64, 32
    starts, ends = [0, 7, 19], [4, 13, 25]
    kvcaches = generate_kv_cache_paged_list_tensors(num_blocks=num_blocks, block_size=block_size,
                                                    num_layers=num_layers, head_size=head_size, device=device)
    _, _, num_heads_actual, head_size_actual = kvcaches[0][0].shape
    hidden_dim_actual = num_heads_actual * head_size_actual
    slot_mapping = _make_unique_slot_mapping(total_slots=num_blocks * block_size, num_tokens=total_tokens,
                                             device=device)
    packed_slot_mapping = _pack_slot_mapping(slot_mapping, starts, ends)
    meta = LMCacheMetadata(model_name="xpu_test_non_layerwise_multi_chunk", world_size=1, local_world_size=1,
                           worker_id=0, local_worker_id=0, kv_dtype=torch.bfloat16,
                           kv_shape=(num_layers, 2, total_tokens, num_heads_actual, head_size_actual))
    conn = VLLMPagedMemXPUConnectorV2.from_metadata(meta, use_gpu=use_gpu, device=device,
                                                    layout_hints={"kv_layout": "NHD"})  # H == N == 8: named
    pin_alloc = PinMemoryAllocator(size=1024 * 1024 * 64)
    memobjs = []
    try:
        for s, e in zip(starts, ends, strict=False):
            memobj = pin_alloc.allocate(torch.Size([2, num_layers, e - s, hidden_dim_actual]), torch.bfloat16,
                                        MemoryFormat.KV_2LTD)
            conn.from_gpu(memobj, start=s, end=e, slot_mapping=slot_mapping, kvcaches=kvcaches)
            memobjs.append((s, e, memobj))
        kvcaches_dst = generate_kv_cache_paged_list_tensors(num_blocks=num_blocks, block_size=block_size,
                                                            num_layers=num_layers, head_size=head_size_actual,
                                                            device=device)
        for layer in kvcaches_dst:
            layer.zero_()
        for s, e, memobj in memobjs:
            conn.to_gpu(memobj, start=s, end=e, slot_mapping=slot_mapping, kvcaches=kvcaches_dst)
        check_paged_kv_cache_equal(kvcaches, kvcaches_dst, packed_slot_mapping, num_heads=num_heads_actual,
                                   head_size=head_size_actual)
    finally:
        for _, _, memobj in memobjs:
            memobj.ref_count_down()
        pin_alloc.close()


def test_xpu_connector_roundtrip_layerwise_multi_chunk_use_gpu_true() -> None:
    _skip_if_no_xpu()
    device = torch.device(DEVICE)
    num_layers, num_blocks, block_size, head_size, total_tokens = 4, 8, 8, 64, 40
    starts, ends = [0, 9, 21], [5, 15, 30]
    kvcaches = generate_kv_cache_paged_list_tensors(num_blocks=num_blocks, block_size=block_size,
                                                    num_layers=num_layers, head_size=head_size, device=device)
    _, _, num_heads_actual, head_size_actual = kvcaches[0][0].shape
    hidden_dim_actual = num_heads_actual * head_size_actual
    slot_mapping = _make_unique_slot_mapping(total_slots=num_blocks * block_size, num_tokens=total_tokens,
                                             device=device)
    packed_slot_mapping = _pack_slot_mapping(slot_mapping, starts, ends)
    meta = LMCacheMetadata(model_name="xpu_test_layerwise_multi_chunk_gpu", world_size=1, local_world_size=1,
                           worker_id=0, local_worker_id=0, kv_dtype=torch.bfloat16,
                           kv_shape=(num_layers, 2, total_tokens, num_heads_actual, head_size_actual))
    conn = VLLMPagedMemLayerwiseXPUConnector.from_metadata(meta, use_gpu=True, device=device,
                                                           layout_hints={"kv_layout": "NHD"})  # H == N == 8: named
    pin_alloc = PinMemoryAllocator(size=1024 * 1024 * 128)
    memobjs_by_layer = [[pin_alloc.allocate(torch.Size([e - s, 2, hidden_dim_actual]), torch.bfloat16,
                                            MemoryFormat.KV_T2D) for s, e in zip(starts, ends, strict=False)]
                        for _ in range(num_layers)]
    try:
        producer = conn.batched_from_gpu(memobjs_by_layer, starts=starts, ends=ends, slot_mapping=slot_mapping,
                                         sync=True, kvcaches=kvcaches)
        for _ in range(num_layers + 1):
            next(producer)
        assert conn.gpu_buffer_allocator is not None
        kvcaches_dst = generate_kv_cache_paged_list_tensors(num_blocks=num_blocks, block_size=block_size,
                                                            num_layers=num_layers, head_size=head_size_actual,
                                                            device=device)
        for layer in kvcaches_dst:
            layer.zero_()
        consumer = conn.batched_to_gpu(starts=starts, ends=ends, slot_mapping=slot_mapping, sync=True,
                                       kvcaches=kvcaches_dst)
        next(consumer)
        for layer_id in range(num_layers):
            consumer.send(memobjs_by_layer[layer_id])
        next(consumer)
        check_paged_kv_cache_equal(kvcaches, kvcaches_dst, packed_slot_mapping, num_heads=num_heads_actual,
                                   head_size=head_size_actual)
    finally:
        for layer in memobjs_by_layer:
            for memobj in layer:
                memobj.ref_count_down()
        pin_alloc.close()
