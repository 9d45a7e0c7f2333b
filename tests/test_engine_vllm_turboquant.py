"""vLLM 0.33's TURBOQUANT_K8V4 cache as the oracle for vllm_turboquant_k8v4: K and V packed in one
slot per (token, head), moved by kvgen both ways with their bytes as they are.

The cache is vLLM's: FullAttentionSpec with kv_quant_mode TURBOQUANT_K8V4, the backend's own
customize_spec (state_content_bytes = TurboQuantConfig.slot_size_aligned), the backend's one
KVCacheLayout (LBNHC), get_kv_cache_config_from_groups and allocate_kv_cache. vLLM's store kernel is
Triton on CUDA, so values are written where it writes them (triton_turboquant_store.py,
_tq_fused_store_fp8): the fp8 key at byte 0 of the slot, the 4-bit value codes two per byte (value
2j low) at key_packed_size, then the fp16 scale and zero. Every byte codes its layer, slot, head and
place; every value code its layer, slot, head and index (so a nibble swap changes it). kvgen stores
the slots into a kv_planes object, whose regions must hold each slot's key, codes, scale and zero,
and loads it into a fresh vLLM cache, read back at vLLM's offsets.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

iface = pytest.importorskip("vllm.v1.kv_cache_interface",
                            reason="vllm 0.33.0 is not installed (scripts/dev installs it unless KVGEN_NO_ENGINES=1)")

from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig  # noqa: E402
from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

import kvgen  # noqa: E402
from kvgen.runtime import MemoryObj  # noqa: E402
from kvgen.spec.library import load_library  # noqa: E402

#: H == N, so a (head, slot) cell read as (slot, head) still fits the tensors and only the values tell.
L, B, N, H, HS = 2, 5, 4, 4, 128
SLOTS = [17, 3, 8, 9, 10, 11, 0, 19, 6]
MODE = "TURBOQUANT_K8V4"
CONFIG = TurboQuantConfig.from_cache_dtype(MODE.lower(), HS)
KEY, VALUES = CONFIG.key_packed_size, CONFIG.value_packed_size - 4  # the value codes' bytes
(LAYOUT,) = TurboQuantAttentionBackend.supported_kv_cache_layouts()


def _vllm_config() -> Any:
    cache = SimpleNamespace(get_resolved_kv_cache_layout=lambda: LAYOUT, prefix_cache_retention_interval=None,
                            num_gpu_blocks_override=B)
    return SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None), cache_config=cache)


def attention_spec() -> Any:
    spec = iface.FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=HS, dtype=torch.uint8,
                                   kv_quant_mode=iface.KVQuantMode[MODE])
    return TurboQuantAttentionBackend.customize_spec(spec)


def allocate() -> tuple[dict[str, torch.Tensor], Any]:
    group = iface.KVCacheGroupSpec([f"attn.{i}" for i in range(L)], attention_spec())
    config = get_kv_cache_config_from_groups(_vllm_config(), [group], 1 << 30)
    config.kv_cache_layout = LAYOUT.name
    return allocate_kv_cache(config, torch.device("cpu"), LAYOUT), config


def code(layer: int, slot: int, h: int, c: int, bits: int) -> int:
    return (c + 3 * h + 5 * slot + 11 * layer) % (1 << bits)


def slot_bytes(layer: int, slot: int, h: int) -> torch.Tensor:
    """One (token, head) slot as the store kernel writes it: key, value codes, scale, zero."""
    key = torch.tensor([code(layer, slot, h, c, 8) for c in range(KEY)], dtype=torch.uint8)
    codes = [code(layer, slot, h, c, 4) for c in range(HS)]
    packed = torch.tensor([codes[2 * j] | codes[2 * j + 1] << 4 for j in range(VALUES)], dtype=torch.uint8)
    scale = torch.tensor([1.0 + layer + slot / 32 + h / 1024], dtype=torch.float16).view(torch.uint8)
    zero = torch.tensor([-2.0 - layer - slot / 64 - h / 2048], dtype=torch.float16).view(torch.uint8)
    pad = torch.zeros(CONFIG.slot_size_aligned - CONFIG.slot_size, dtype=torch.uint8)
    return torch.cat([key, packed, scale, zero, pad])


def cells(view: torch.Tensor) -> torch.Tensor:
    """vLLM's page as the kernel addresses it: (num_blocks, block_size, Hk, slot_size)."""
    return view.transpose(1, 2)  # the logical [B, H, N, C] view of an LBNHC page


def write(kv: dict[str, torch.Tensor]) -> None:
    for layer in range(L):
        page = cells(kv[f"attn.{layer}"])
        for slot in range(B * N):
            for h in range(H):
                page[slot // N, slot % N, h] = slot_bytes(layer, slot, h)


def test_the_engines_spec_is_the_specs_slot() -> None:
    spec = attention_spec()
    assert spec.state_content_bytes == CONFIG.slot_size_aligned == KEY + VALUES + 4
    kv, _ = allocate()
    assert tuple(kv["attn.0"].shape) == (B, H, N, CONFIG.slot_size_aligned)  # the logical view
    assert cells(kv["attn.0"]).is_contiguous()  # LBNHC: a page is [N, H, slot]


def test_the_engines_cache_moves_both_ways_at_its_offsets() -> None:
    kv, config = allocate()
    write(kv)
    (group,) = kvgen.from_vllm(kv, config, LAYOUT, engine_version="0.33.0")
    assert (group.detection.layout, group.connector.memory.name) == ("vllm_turboquant_k8v4", "kv_planes")
    connector = group.connector  # given the leaves in the spec's memory order, as from_vllm hands them
    obj = MemoryObj(torch.zeros(tuple(connector.get_shape(len(SLOTS), group.kvcaches)), dtype=torch.uint8))
    connector.from_gpu(obj, 0, len(SLOTS), kvcaches=group.kvcaches, slot_mapping=torch.tensor(SLOTS))
    # kv_planes: per layer each field's dense [T, H, bytes] region, each at a multiple of 16
    t = len(SLOTS)
    widths = {"key": KEY, "values": VALUES, "scale": 2, "zero": 2}
    starts, at = {}, 0
    for name, width in widths.items():
        starts[name] = at
        at += -(-t * H * width // 16) * 16
    offsets = {"key": 0, "values": KEY, "scale": KEY + VALUES, "zero": KEY + VALUES + 2}
    for layer in range(L):
        for name, width in widths.items():
            region = obj.tensor[layer, starts[name]:starts[name] + t * H * width].reshape(t, H, width)
            for k, slot in enumerate(SLOTS):
                for h in range(H):
                    want = slot_bytes(layer, slot, h)[offsets[name]:offsets[name] + width]
                    assert torch.equal(region[k, h], want), (layer, name, slot, h)
    fresh, fresh_config = allocate()
    (target,) = kvgen.from_vllm(fresh, fresh_config, LAYOUT, engine_version="0.33.0")
    target.connector.to_gpu(obj, 0, len(SLOTS), kvcaches=target.kvcaches, slot_mapping=torch.tensor(SLOTS))
    for layer in range(L):
        page = cells(fresh[f"attn.{layer}"])
        for slot in range(B * N):
            for h in range(H):
                want = slot_bytes(layer, slot, h) if slot in SLOTS else torch.zeros(CONFIG.slot_size_aligned,
                                                                                     dtype=torch.uint8)
                assert torch.equal(page[slot // N, slot % N, h], want), (layer, slot, h)


def test_a_value_code_is_the_nibble_the_kernel_wrote() -> None:
    """The spec's packing (low_first) decodes the value codes the kernel packed: value 2j low."""
    spec = load_library()["vllm_turboquant_k8v4"]
    values = next(f for p in spec.parts for f in p.fields if f.name == "values")
    assert str(values.packing) == "low_first"
    packed = slot_bytes(1, 9, 2)[KEY:KEY + VALUES]
    assert [int(packed[c // 2]) >> (4 * (c % 2)) & 0xF for c in range(HS)] == [code(1, 9, 2, c, 4) for c in range(HS)]
