"""vLLM 0.33's OCTAVE caches as the oracle for the vllm_octave_* specs (K3V4, K3V3, K3V3_COMPACT): K and
V packed in one slot per (token, KV head), moved by kvgen both ways with their bytes as they are.

The cache is vLLM's: FullAttentionSpec with the kv_quant_mode, RocmOctaveAttentionBackend.customize_spec
(state_content_bytes = OctaveFormat.slot_bytes; the kernels' head size 256 and rotary dim 64, registered
with register_rope_dim as vLLM does from the model config), KVCacheLayout LBHNC,
get_kv_cache_config_from_groups and allocate_kv_cache. The backend's kernels are ROCm only; the slots
are what the format's own PyTorch reference writes (rocm_octave.reference_quantize), put at each slot's
(block, head, position) as the store kernel does, and read back with reference_dequantize. K and V
vary with layer, token, head and dim, so every slot's bytes differ. kvgen stores the slots into a
kv_planes object, whose regions must hold each slot's fields where OctaveFormat's offsets put them,
loads it into a fresh vLLM cache at other slots, and vLLM's reference must dequantize there exactly
what it dequantizes at the original slots.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness import builtin_library, vllm_module

iface = vllm_module("vllm.v1.kv_cache_interface")


octave_attn = vllm_module("vllm.v1.attention.backends.rocm_octave_attn")
sq = vllm_module("vllm.v1.attention.ops.rocm_octave")
planning = vllm_module("vllm.v1.core.kv_cache_planning")
worker = vllm_module("vllm.v1.worker.utils")
vllm_layouts = vllm_module("vllm.v1.kv_cache_layout")

import kvgen  # noqa: E402
from kvgen.oracle.reference import Span  # noqa: E402
from kvgen.oracle.reference import planes as reference  # noqa: E402
from kvgen.runtime import MemoryObj  # noqa: E402
from kvgen.spec.model import Spec  # noqa: E402

LIBRARY = builtin_library()
L, B, N, H, HS, ROPE = 2, 4, 16, 2, 256, 64
SLOTS = torch.tensor([17, 3, 40, 16, 31, 63, 50, 5])
AGAIN = torch.tensor([60, 1, 33, 20, 7, 45, 28, 12])
MODES = ("OCTAVE_K3V4", "OCTAVE_K3V3", "OCTAVE_K3V3_COMPACT")


def _layout() -> Any:
    """vLLM's KVCacheLayout of these caches (read when a test runs: vLLM is not imported at collection)."""
    return vllm_layouts.KVCacheLayout.LBHNC


@pytest.fixture(autouse=True, scope="module")
def _rope_dim() -> None:
    """What vLLM registers from the model's rotary dim before sizing the cache."""
    sq.register_rope_dim(HS, ROPE)


def fmt(mode: str) -> Any:
    return sq.OctaveFormat.from_cache_dtype(mode.lower(), HS, ROPE)


def _vllm_config() -> Any:
    cache = SimpleNamespace(get_resolved_kv_cache_layout=_layout, prefix_cache_retention_interval=None,
                            num_gpu_blocks_override=B)
    return SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None), cache_config=cache)


def allocate(mode: str) -> tuple[dict[str, torch.Tensor], Any]:
    spec = octave_attn.RocmOctaveAttentionBackend.customize_spec(iface.FullAttentionSpec(
        block_size=N, num_kv_heads=H, head_size=HS, dtype=torch.uint8, kv_quant_mode=iface.KVQuantMode[mode]))
    group = iface.KVCacheGroupSpec([f"attn.{i}" for i in range(L)], spec)
    config = planning.get_kv_cache_config_from_groups(_vllm_config(), [group], 1 << 30)
    config.kv_cache_layout = _layout().name
    kv = worker.allocate_kv_cache(config, torch.device("cpu"), _layout())
    for view in kv.values():
        view.zero_()
    return kv, config


def inputs(layer: int, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [tokens, H, HS] for these token ids: every (layer, token, head, dim) its own value."""
    t = tokens.reshape(-1, 1, 1).float()
    h = torch.arange(H).reshape(1, -1, 1).float()
    d = torch.arange(HS).reshape(1, 1, -1).float()
    k = torch.sin(0.37 * d + 1.3 * t + 0.7 * h + 2.1 * layer) * (1 + t / 8)
    v = torch.cos(0.23 * d + 0.9 * t + 1.1 * h + 0.5 * layer) * (2 + h + t / 16)
    return k, v


def write(mode: str, kv: dict[str, torch.Tensor], slots: torch.Tensor) -> None:
    """vLLM's reference slots of tokens SLOTS, each put at its (block, head, position) of `slots`."""
    for layer in range(L):
        packed = sq.reference_quantize(*inputs(layer, SLOTS), fmt(mode))  # [T, H, slot]
        page = kv[f"attn.{layer}"]  # the logical [B, H, N, slot], LBHNC's memory order
        for t, slot in enumerate(slots.tolist()):
            page[slot // N, :, slot % N] = packed[t]


def read(kv: dict[str, torch.Tensor], layer: int, slots: torch.Tensor, mode: str) -> tuple[torch.Tensor, ...]:
    """What vLLM's reference dequantizes at `slots`: K and V [T, H, HS]."""
    page = kv[f"attn.{layer}"]
    return sq.reference_dequantize(page[slots // N, :, slots % N], fmt(mode))


def fields(mode: str) -> list[tuple[str, int, int]]:
    """(field, start, end) of a slot from OctaveFormat's own offsets, in order."""
    f = fmt(mode)
    out = [] if f.compact else [("k_rope", 0, f.off_k_nope)]
    out += [("k_nope", f.off_k_nope, f.off_v), ("v_codes", f.off_v, f.off_scales),
            ("scales", f.off_scales, f.off_scales + 2 * f.num_scales)]
    if f.slot_bytes > out[-1][2]:
        out.append(("pad", out[-1][2], f.slot_bytes))
    return out


def check_object(mode: str, obj: torch.Tensor, kv: dict[str, torch.Tensor]) -> None:
    """kv_planes: per layer each field's dense [T, H, bytes] region, each at a multiple of 16, holding
    the bytes the slot keeps at OctaveFormat's offsets."""
    t = len(SLOTS)
    for layer in range(L):
        page, at = kv[f"attn.{layer}"], 0
        slots = page[SLOTS // N, :, SLOTS % N]  # [T, H, slot]
        for name, start, end in fields(mode):
            width = end - start
            region = obj[layer, at:at + t * H * width].reshape(t, H, width)
            assert torch.equal(region, slots[..., start:end]), (mode, layer, name)
            at += -(-t * H * width // 16) * 16


@pytest.mark.parametrize("mode", MODES)
def test_the_engines_slot_is_the_specs_row(mode: str) -> None:
    kv, _ = allocate(mode)
    assert tuple(kv["attn.0"].shape) == (B, H, N, fmt(mode).slot_bytes) and kv["attn.0"].is_contiguous()
    spec = LIBRARY[f"vllm_{mode.lower()}"]
    assert [(f.name, f.offset, f.end) for f in spec.parts[0].fields] == fields(mode)


@pytest.mark.parametrize("mode", MODES)
def test_the_engines_cache_moves_both_ways_and_vllm_dequantizes_the_same(mode: str) -> None:
    kv, config = allocate(mode)
    write(mode, kv, SLOTS)
    (group,) = kvgen.from_vllm(kv, config, _layout(), engine_version="0.33.0")
    assert (group.detection.layout, group.connector.memory.name) == (f"vllm_{mode.lower()}", "kv_planes")
    obj = MemoryObj(torch.zeros(tuple(group.connector.get_shape(len(SLOTS), group.kvcaches)), dtype=torch.uint8))
    group.connector.from_gpu(obj, 0, len(SLOTS), kvcaches=group.kvcaches, slot_mapping=SLOTS)
    check_object(mode, obj.tensor, kv)
    fresh, fresh_config = allocate(mode)
    (target,) = kvgen.from_vllm(fresh, fresh_config, _layout(), engine_version="0.33.0")
    target.connector.to_gpu(obj, 0, len(SLOTS), kvcaches=target.kvcaches, slot_mapping=AGAIN)
    oracle, _ = allocate(mode)
    write(mode, oracle, AGAIN)  # the reference itself at AGAIN
    for layer in range(L):
        assert torch.equal(fresh[f"attn.{layer}"], oracle[f"attn.{layer}"])  # every byte, moved and not moved
        for got, want in zip(read(fresh, layer, AGAIN, mode), read(kv, layer, SLOTS, mode), strict=True):
            assert torch.equal(got, want)


def _swapped(spec: Spec, a: str, b: str) -> Spec:
    """`spec` with fields a and b in each other's order (a mutant only the reference reads)."""
    part = spec.parts[0]
    order = [f.name for f in part.fields]
    i, j = order.index(a), order.index(b)
    by_name = {f.name: f for f in part.fields}
    order[i], order[j] = order[j], order[i]
    at, out = 0, []
    for name in order:
        out.append(dataclasses.replace(by_name[name], offset=at))
        at += by_name[name].nbytes
    return dataclasses.replace(spec, parts=(dataclasses.replace(part, fields=tuple(out)),))


@pytest.mark.parametrize("mode", MODES)
def test_scales_read_at_the_codes_bytes_fail(mode: str) -> None:
    """The reference, reading the cache as the spec says, fills the object as the connector does; with
    the V codes and the scales in each other's place it puts other bytes in the scale region."""
    kv, _ = allocate(mode)
    write(mode, kv, SLOTS)
    spec = LIBRARY[f"vllm_{mode.lower()}"]
    leaves = [kv[f"attn.{layer}"] for layer in range(L)]
    ext = {"L": L, "B": B, "N": N, "H": H, "C": fmt(mode).slot_bytes}

    def stored(s: Spec) -> torch.Tensor:
        connector = kvgen.generated.get(spec.name, "kv_planes")()
        obj = torch.zeros(tuple(connector.get_shape(len(SLOTS), leaves)), dtype=torch.uint8)
        reference.store(s, LIBRARY["kv_planes"], ext, leaves, obj, Span(SLOTS.tolist(), 0, len(SLOTS)))
        return obj

    check_object(mode, stored(spec), kv)
    with pytest.raises(AssertionError):
        check_object(mode, stored(_swapped(spec, "v_codes", "scales")), kv)
