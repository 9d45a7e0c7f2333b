"""vLLM 0.33's NVFP4_DS_MLA cache (FlashMLA sparse, DeepSeek V3.2 geometry) as the oracle for
vllm_nvfp4_ds_mla: per token one 352-byte row, moved by kvgen both ways with its bytes as they are.

The cache is vLLM's: MLAAttentionSpec with kv_quant_mode NVFP4_DS_MLA and the state_content_bytes
MLAAttention.get_kv_cache_spec gives it (352), get_kv_cache_config_from_groups and allocate_kv_cache
(the [B, 1, N, 352] MLA view). vLLM writes it only in CUDA (csrc/cache_kernels.cu), so rows are
written as flashmla_sparse.py lays them out: 512 e2m1 NoPE codes two per byte (low nibble the even
element), 64 fp8 RoPE bytes, then 32 fp8 scales, the scale of element block s at byte
8 * (s & 3) + (s >> 2). Every code and byte encodes its layer, slot and place. kvgen stores the slots
into a kv_planes object and loads them into a fresh cache at other slots; the spec's own arithmetic
decodes every NoPE code where the engine packed it (a nibble swap does not), and every scale byte
keeps its permuted place.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch
from harness import builtin_library, vllm_module

iface = vllm_module("vllm.v1.kv_cache_interface")


planning = vllm_module("vllm.v1.core.kv_cache_planning")
worker = vllm_module("vllm.v1.worker.utils")
vllm_layouts = vllm_module("vllm.v1.kv_cache_layout")

import kvgen  # noqa: E402
from kvgen.oracle.address import packed_value, plane_address  # noqa: E402
from kvgen.runtime import MemoryObj  # noqa: E402
from kvgen.spec.model import Packing, Spec  # noqa: E402

LIBRARY = builtin_library()
SPEC = LIBRARY["vllm_nvfp4_ds_mla"]
L, B, N = 2, 4, 16
SLOTS = torch.tensor([17, 3, 40, 16, 31, 63, 50, 5])
AGAIN = torch.tensor([60, 1, 33, 20, 7, 45, 28, 12])
NOPE, ROPE, SCALES, ROW = 512, 64, 32, 352


def _layout() -> Any:
    """vLLM's KVCacheLayout of these caches (read when a test runs: vLLM is not imported at collection)."""
    return vllm_layouts.KVCacheLayout.LBNHC


def allocate() -> tuple[dict[str, torch.Tensor], Any]:
    spec = iface.MLAAttentionSpec(block_size=N, num_kv_heads=1, head_size=576, dtype=torch.uint8,
                                  cache_dtype_str="nvfp4_ds_mla", kv_quant_mode=iface.KVQuantMode.NVFP4_DS_MLA,
                                  state_content_bytes=ROW)  # as MLAAttention.get_kv_cache_spec sets them
    cache = SimpleNamespace(get_resolved_kv_cache_layout=_layout, prefix_cache_retention_interval=None,
                            num_gpu_blocks_override=B)
    vllm_config = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None), cache_config=cache)
    group = iface.KVCacheGroupSpec([f"attn.{i}" for i in range(L)], spec)
    config = planning.get_kv_cache_config_from_groups(vllm_config, [group], 1 << 30)
    config.kv_cache_layout = _layout().name
    kv = worker.allocate_kv_cache(config, torch.device("cpu"), _layout())
    for view in kv.values():
        view.zero_()
    return kv, config


def code(layer: int, token: int, c: int) -> int:
    return (c + 5 * token + 3 * layer) % 16


def scale_of(layer: int, token: int, s: int) -> int:
    """The fp8 scale byte of element block s: its block, token and layer."""
    return (7 * s + 31 * token + 101 * layer + 1) % 256


def row(layer: int, token: int) -> torch.Tensor:
    """One token's 352 bytes as flashmla_sparse.py lays them out."""
    codes = [code(layer, token, c) for c in range(NOPE)]
    nope = [codes[2 * j] | codes[2 * j + 1] << 4 for j in range(NOPE // 2)]
    rope = [(c + 13 * token + 7 * layer) % 256 for c in range(ROPE)]
    scales = [0] * SCALES
    for s in range(SCALES):
        scales[8 * (s & 3) + (s >> 2)] = scale_of(layer, token, s)
    return torch.tensor(nope + rope + scales, dtype=torch.uint8)


def write(kv: dict[str, torch.Tensor], slots: torch.Tensor) -> None:
    """Rows of tokens SLOTS at `slots`."""
    for layer in range(L):
        for token, slot in zip(SLOTS.tolist(), slots.tolist(), strict=True):
            kv[f"attn.{layer}"][slot // N, 0, slot % N] = row(layer, token)


def test_the_engines_cache_is_the_specs_rows() -> None:
    kv, _ = allocate()
    assert tuple(kv["attn.0"].shape) == (B, 1, N, ROW) and kv["attn.0"].is_contiguous()
    assert SPEC.parts[0].row_bytes == ROW


def test_the_cache_moves_both_ways_at_its_offsets() -> None:
    kv, config = allocate()
    write(kv, SLOTS)
    (group,) = kvgen.from_vllm(kv, config, _layout(), engine_version="0.33.0")
    assert (group.detection.layout, group.connector.memory.name) == ("vllm_nvfp4_ds_mla", "kv_planes")
    obj = MemoryObj(torch.zeros(tuple(group.connector.get_shape(len(SLOTS), group.kvcaches)), dtype=torch.uint8))
    group.connector.from_gpu(obj, 0, len(SLOTS), kvcaches=group.kvcaches, slot_mapping=SLOTS)
    t, at = len(SLOTS), 0  # kv_planes: per layer each field's dense [T, bytes] region, each at a multiple of 16
    for name, start, width in (("nope", 0, NOPE // 2), ("rope", NOPE // 2, ROPE), ("scale", NOPE // 2 + ROPE, SCALES)):
        for layer in range(L):
            region = obj.tensor[layer, at:at + t * width].reshape(t, width)
            for k, token in enumerate(SLOTS.tolist()):
                assert torch.equal(region[k], row(layer, token)[start:start + width]), (name, layer, token)
        at += -(-t * width // 16) * 16
    fresh, fresh_config = allocate()
    oracle, _ = allocate()
    write(oracle, AGAIN)
    (target,) = kvgen.from_vllm(fresh, fresh_config, _layout(), engine_version="0.33.0")
    target.connector.to_gpu(obj, 0, len(SLOTS), kvcaches=target.kvcaches, slot_mapping=AGAIN)
    for layer in range(L):
        assert torch.equal(fresh[f"attn.{layer}"], oracle[f"attn.{layer}"])  # every byte, moved and not moved


def decode(spec: Spec, kv: dict[str, torch.Tensor], layer: int, slot: int) -> tuple[list[int], list[int]]:
    """NoPE codes and the scale bytes by block, by the spec's arithmetic; scale block s read at the
    byte the engine's permutation gives it within the spec's scale field."""
    planes = {p.name: p for p in spec.moved_planes()}
    leaf = kv[f"attn.{layer}"]
    ext = {"L": L, "B": B, "N": N, "C": ROW}
    codes = []
    for c in range(NOPE):
        unit, shift = packed_value(planes["nope"].field, c)
        _, index, _ = plane_address(spec, planes["nope"], {"l": layer, "slot": slot, "c": unit}, ext, 1)
        codes.append(int(leaf[index]) >> shift & 0xF)
    scales = []
    for s in range(SCALES):
        _, index, _ = plane_address(spec, planes["scale"], {"l": layer, "slot": slot, "c": 8 * (s & 3) + (s >> 2)},
                                    ext, 1)
        scales.append(int(leaf[index]))
    return codes, scales


def test_the_specs_arithmetic_finds_every_code_and_scale_and_a_nibble_swap_does_not() -> None:
    kv, _ = allocate()
    write(kv, SLOTS)
    for layer, t in ((0, 0), (1, 5)):
        token, slot = int(SLOTS[t]), int(SLOTS[t])
        codes, scales = decode(SPEC, kv, layer, slot)
        assert codes == [code(layer, token, c) for c in range(NOPE)]
        assert scales == [scale_of(layer, token, s) for s in range(SCALES)]
    part = SPEC.parts[0]
    swapped = dataclasses.replace(SPEC, parts=(dataclasses.replace(part, fields=tuple(
        dataclasses.replace(f, packing=Packing.HIGH_FIRST) if f.name == "nope" else f for f in part.fields)),))
    assert decode(swapped, kv, 0, int(SLOTS[0]))[0] != [code(0, int(SLOTS[0]), c) for c in range(NOPE)]
