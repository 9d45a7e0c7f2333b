"""vLLM 0.33's TURBOQUANT caches as the oracle for the vllm_turboquant_* specs (K8V4, 4BIT_NC, K3V4_NC,
3BIT_NC): K and V packed in one slot per (token, head), moved by kvgen both ways with their bytes as
they are.

The cache is vLLM's: FullAttentionSpec with the kv_quant_mode, the backend's own customize_spec
(state_content_bytes = TurboQuantConfig.slot_size_aligned), the backend's one KVCacheLayout (LBNHC),
get_kv_cache_config_from_groups and allocate_kv_cache. vLLM's store kernel is Triton on CUDA (on a CPU,
vllm.triton_utils hands it a placeholder triton: `triton.next_power_of_2` does not exist there), so
values are written where it writes them (triton_turboquant_store.py, _tq_fused_store_fp8 and
_tq_fused_store_mse, _store_quantized_value): the fp8 key, or the MSE key indices and then the key's
fp16 norm, from byte 0 of the slot; the value codes at key_packed_size, then the fp16 scale and zero.
4-bit codes pack two per byte (code 2j low), 3-bit codes eight per three bytes (code j of a group at
bit 3j of its little-endian 24 bits). Every byte codes its layer, slot, head and place; every code its
layer, slot, head and index (so a nibble swap or a shifted bit stream changes it). kvgen stores the
slots into a kv_planes object, whose regions must hold each slot's fields, and loads it into a fresh
vLLM cache, read back at vLLM's offsets.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness import builtin_library, vllm_module

iface = vllm_module("vllm.v1.kv_cache_interface")

tq_config = vllm_module("vllm.model_executor.layers.quantization.turboquant.config")
tq_attn = vllm_module("vllm.v1.attention.backends.turboquant_attn")
planning = vllm_module("vllm.v1.core.kv_cache_planning")
worker = vllm_module("vllm.v1.worker.utils")

import kvgen  # noqa: E402
from kvgen.oracle.address import packed_value, plane_address  # noqa: E402
from kvgen.runtime import KVLayoutError, MemoryObj  # noqa: E402
from kvgen.spec.model import Packing  # noqa: E402

LIBRARY = builtin_library()
#: H == N, so a (head, slot) cell read as (slot, head) still fits the tensors and only the values tell.
L, B, N, H, HS = 2, 5, 4, 4, 128
SLOTS = [17, 3, 8, 9, 10, 11, 0, 19, 6]
MODES = ("TURBOQUANT_K8V4", "TURBOQUANT_4BIT_NC", "TURBOQUANT_K3V4_NC", "TURBOQUANT_3BIT_NC")


def _layout() -> Any:
    """The one KVCacheLayout the backend supports (read when a test runs: vLLM is not imported at
    collection)."""
    (layout,) = tq_attn.TurboQuantAttentionBackend.supported_kv_cache_layouts()
    return layout


def config(mode: str) -> Any:
    return tq_config.TurboQuantConfig.from_cache_dtype(mode.lower(), HS)


def spec_name(mode: str) -> str:
    return f"vllm_{mode.lower()}"


def _vllm_config() -> Any:
    cache = SimpleNamespace(get_resolved_kv_cache_layout=_layout, prefix_cache_retention_interval=None,
                            num_gpu_blocks_override=B)
    return SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None), cache_config=cache)


def attention_spec(mode: str) -> Any:
    spec = iface.FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=HS, dtype=torch.uint8,
                                   kv_quant_mode=iface.KVQuantMode[mode])
    return tq_attn.TurboQuantAttentionBackend.customize_spec(spec)


def allocate(mode: str) -> tuple[dict[str, torch.Tensor], Any]:
    group = iface.KVCacheGroupSpec([f"attn.{i}" for i in range(L)], attention_spec(mode))
    config_ = planning.get_kv_cache_config_from_groups(_vllm_config(), [group], 1 << 30)
    config_.kv_cache_layout = _layout().name
    return worker.allocate_kv_cache(config_, torch.device("cpu"), _layout()), config_


def code(layer: int, slot: int, h: int, c: int, bits: int) -> int:
    return (c + 3 * h + 5 * slot + 11 * layer) % (1 << bits)


def pack(codes: list[int], bits: int) -> torch.Tensor:
    """Codes as the store kernel packs them: bytes as they are, two 4-bit codes per byte (code 2j
    low), or eight 3-bit codes per three bytes (packed_24 = sum(code_j << 3j), little-endian)."""
    if bits == 8:
        return torch.tensor(codes, dtype=torch.uint8)
    if bits == 4:
        return torch.tensor([codes[2 * j] | codes[2 * j + 1] << 4 for j in range(len(codes) // 2)], dtype=torch.uint8)
    out = []
    for g in range(len(codes) // 8):
        packed_24 = sum(codes[8 * g + j] << 3 * j for j in range(8))
        out += [packed_24 & 0xFF, packed_24 >> 8 & 0xFF, packed_24 >> 16 & 0xFF]
    return torch.tensor(out, dtype=torch.uint8)


def half(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float16).view(torch.uint8)


def fields(mode: str, layer: int, slot: int, h: int) -> dict[str, torch.Tensor]:
    """One (token, head) slot's fields as the store kernel writes them, in slot order."""
    cfg = config(mode)
    out = {"key": pack([code(layer, slot, h, c, cfg.key_quant_bits) for c in range(HS)], cfg.key_quant_bits)}
    if not cfg.key_fp8:
        out["norm"] = half(0.5 + layer + slot / 16 + h / 256)
    out["values"] = pack([code(layer, slot, h, c + 1, cfg.value_quant_bits) for c in range(HS)], cfg.value_quant_bits)
    out["scale"] = half(1.0 + layer + slot / 32 + h / 1024)
    out["zero"] = half(-2.0 - layer - slot / 64 - h / 2048)
    return out


def slot_bytes(mode: str, layer: int, slot: int, h: int) -> torch.Tensor:
    cfg = config(mode)
    pad = torch.zeros(cfg.slot_size_aligned - cfg.slot_size, dtype=torch.uint8)
    return torch.cat([*fields(mode, layer, slot, h).values(), pad])


def cells(view: torch.Tensor) -> torch.Tensor:
    """vLLM's page as the kernel addresses it: (num_blocks, block_size, Hk, slot_size)."""
    return view.transpose(1, 2)  # the logical [B, H, N, C] view of an LBNHC page


def write(mode: str, kv: dict[str, torch.Tensor]) -> None:
    for layer in range(L):
        page = cells(kv[f"attn.{layer}"])
        for slot in range(B * N):
            for h in range(H):
                page[slot // N, slot % N, h] = slot_bytes(mode, layer, slot, h)


@pytest.mark.parametrize("mode", MODES)
def test_the_engines_spec_is_the_specs_slot(mode: str) -> None:
    cfg = config(mode)
    spec = attention_spec(mode)
    assert spec.state_content_bytes == cfg.slot_size_aligned == sum(len(f) for f in fields(mode, 0, 0, 0).values())
    assert cfg.key_packed_size == sum(len(f) for n, f in fields(mode, 0, 0, 0).items() if n in ("key", "norm"))
    kv, _ = allocate(mode)
    assert tuple(kv["attn.0"].shape) == (B, H, N, cfg.slot_size_aligned)  # the logical view
    assert cells(kv["attn.0"]).is_contiguous()  # LBNHC: a page is [N, H, slot]
    assert LIBRARY[spec_name(mode)].parts[0].row_bytes == cfg.slot_size_aligned


@pytest.mark.parametrize("mode", MODES)
def test_the_engines_cache_moves_both_ways_at_its_offsets(mode: str) -> None:
    kv, config_ = allocate(mode)
    write(mode, kv)
    (group,) = kvgen.from_vllm(kv, config_, _layout(), engine_version="0.33.0")
    assert (group.detection.layout, group.connector.memory.name) == (spec_name(mode), "kv_planes")
    connector = group.connector  # given the leaves in the spec's memory order, as from_vllm hands them
    obj = MemoryObj(torch.zeros(tuple(connector.get_shape(len(SLOTS), group.kvcaches)), dtype=torch.uint8))
    connector.from_gpu(obj, 0, len(SLOTS), kvcaches=group.kvcaches, slot_mapping=torch.tensor(SLOTS))
    # kv_planes: per layer each field's dense [T, H, bytes] region, each at a multiple of 16
    t = len(SLOTS)
    widths = {name: len(f) for name, f in fields(mode, 0, 0, 0).items()}
    starts, at = {}, 0
    for name, width in widths.items():
        starts[name] = at
        at += -(-t * H * width // 16) * 16
    for layer in range(L):
        for name, width in widths.items():
            region = obj.tensor[layer, starts[name]:starts[name] + t * H * width].reshape(t, H, width)
            for k, slot in enumerate(SLOTS):
                for h in range(H):
                    assert torch.equal(region[k, h], fields(mode, layer, slot, h)[name]), (layer, name, slot, h)
    fresh, fresh_config = allocate(mode)
    (target,) = kvgen.from_vllm(fresh, fresh_config, _layout(), engine_version="0.33.0")
    target.connector.to_gpu(obj, 0, len(SLOTS), kvcaches=target.kvcaches, slot_mapping=torch.tensor(SLOTS))
    size = config(mode).slot_size_aligned
    for layer in range(L):
        page = cells(fresh[f"attn.{layer}"])
        for slot in range(B * N):
            for h in range(H):
                want = slot_bytes(mode, layer, slot, h) if slot in SLOTS else torch.zeros(size, dtype=torch.uint8)
                assert torch.equal(page[slot // N, slot % N, h], want), (layer, slot, h)


def decoded(spec: Any, page: torch.Tensor, layer: int, slot: int, h: int, name: str) -> list[int]:
    """The codes of field `name` at (layer, slot, h), found by the spec's own arithmetic: the plane's
    address of each value's first byte (packed_value), its bits read from a little-endian 16-bit window."""
    plane = next(p for p in spec.moved_planes() if p.name == name)
    ext = {"L": L, "B": B, "N": N, "H": H, "C": page.shape[-1]}
    out = []
    for c in range(plane.field.count):
        unit, shift = packed_value(plane.field, c)
        _, index, _ = plane_address(spec, plane, {"l": layer, "slot": slot, "h": h, "c": unit}, ext, 1)
        window = int(page[index]) | (int(page[(*index[:-1], index[-1] + 1)]) << 8 if index[-1] + 1 < ext["C"] else 0)
        out.append(window >> shift & (1 << plane.field.bits) - 1)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_every_code_is_the_bits_the_kernel_wrote_and_a_shifted_stream_is_not(mode: str) -> None:
    """The spec's packing decodes the codes where the kernel packed them (two per byte, or eight per
    three bytes); the field read from one packed unit later, or with its nibbles swapped, does not."""
    kv, _ = allocate(mode)
    write(mode, kv)
    spec, cfg = LIBRARY[spec_name(mode)], config(mode)
    page = cells(kv["attn.1"])
    for slot, h in ((9, 2), (19, 3)):
        assert decoded(spec, page, 1, slot, h, "values") == [code(1, slot, h, c + 1, cfg.value_quant_bits)
                                                            for c in range(HS)]
        if not cfg.key_fp8:
            keys = [code(1, slot, h, c, cfg.key_quant_bits) for c in range(HS)]
            assert decoded(spec, page, 1, slot, h, "key") == keys
    values = next(f for p in spec.parts for f in p.fields if f.name == "values")
    unit = 3 if values.bits == 3 else 1  # bytes of one packed unit: eight 3-bit codes, or two 4-bit ones
    later = _with_values(spec, offset=values.offset + unit)
    assert decoded(later, page, 1, 9, 2, "values") != decoded(spec, page, 1, 9, 2, "values")
    if values.bits == 4:  # a nibble swap
        swapped = _with_values(spec, packing=Packing.HIGH_FIRST)
        assert decoded(swapped, page, 1, 9, 2, "values") != decoded(spec, page, 1, 9, 2, "values")


def _with_values(spec: Any, **changes: Any) -> Any:
    """`spec` with its values field changed (a mutant only the reference reads)."""
    part = spec.parts[0]
    fields_ = tuple(dataclasses.replace(f, **changes) if f.name == "values" else f for f in part.fields)
    return dataclasses.replace(spec, parts=(dataclasses.replace(part, fields=fields_),))


@pytest.mark.parametrize("mode", MODES[:2])
def test_soa_pages_where_vllm_runs_flydsl_are_refused_not_misread(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where FlyDSL runs (ROCm gfx950) vLLM's TurboQuant backend stores its pages SoA in an
    allocation of the same size; kvgen asks vLLM's own switch and refuses such a cache. Here (no
    FlyDSL) the switch is off, and the same cache binds to the per-slot spec."""
    flydsl = importlib.import_module("vllm.v1.attention.ops.flydsl_turboquant_decode")
    assert flydsl.is_flydsl_available() is False
    kv, config_ = allocate(mode)
    (group,) = kvgen.from_vllm(kv, config_, _layout(), engine_version="0.33.0")
    assert group.detection.layout == spec_name(mode)
    monkeypatch.setattr(flydsl, "is_flydsl_available", lambda: True)
    with pytest.raises(KVLayoutError, match=f"kv_quant_mode={mode}.*FlyDSL.*SoA"):
        kvgen.from_vllm(kv, config_, _layout(), engine_version="0.33.0")
