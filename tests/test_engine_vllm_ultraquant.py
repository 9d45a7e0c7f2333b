"""vLLM 0.33's ULTRAQUANT_4BIT cache as the oracle for vllm_ultraquant_4bit: per (token, head) one slot
of fp4 K codes, UE8M0 K scales, fp4 V codes and UE8M0 V scales, moved by kvgen both ways with its bytes
as they are.

The cache is vLLM's: FullAttentionSpec with kv_quant_mode ULTRAQUANT_4BIT, the backend's customize_spec
(state_content_bytes = ultraquant format.slot_size; restated from its one line, since
ultraquant_attn.py does not import on a CPU: its Triton decode module reads `tl.float16` from
vllm.triton_utils' placeholder), the KVCacheLayout of its parent TurboQuantAttentionBackend (LBNHC),
get_kv_cache_config_from_groups and allocate_kv_cache. The backend's store kernel
is Triton; its bit-exact PyTorch ground truth, ultraquant_encode, encodes K and V (codes and scales
that vary with layer, token, head and dim), and each slot is assembled at format.py's own offsets
(k_codes_offset, k_scales_offset, v_codes_offset, v_scales_offset). kvgen stores the slots into a
kv_planes object and loads them into a fresh cache at other slots; every byte must be where vLLM put it,
and the spec's own arithmetic (value c: its nibble times 2 ** (scale byte c // 32 - 127)) must give what
vLLM's ultraquant_dequant gives, while a nibble swap or a scale of the next group does not.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch
from harness import builtin_library, vllm_module

iface = vllm_module("vllm.v1.kv_cache_interface")


tq_attn = vllm_module("vllm.v1.attention.backends.turboquant_attn")
uqf = vllm_module("vllm.v1.attention.ops.ultraquant.format")
uq_reference = vllm_module("vllm.v1.attention.ops.ultraquant.reference")
planning = vllm_module("vllm.v1.core.kv_cache_planning")
worker = vllm_module("vllm.v1.worker.utils")

import kvgen  # noqa: E402
from kvgen.oracle.address import packed_value, plane_address, scale_index  # noqa: E402
from kvgen.runtime import MemoryObj  # noqa: E402
from kvgen.spec.model import Packing, Spec  # noqa: E402

LIBRARY = builtin_library()
SPEC = LIBRARY["vllm_ultraquant_4bit"]
#: H == N, so a (head, slot) cell read as (slot, head) still fits the tensors and only the values tell.
L, B, N, H, HS = 2, 5, 4, 4, 128
SLOTS = torch.tensor([17, 3, 8, 9, 10, 11, 0, 19])
AGAIN = torch.tensor([1, 12, 5, 18, 2, 14, 7, 16])


def _layout() -> Any:
    """The one KVCacheLayout the backend supports (UltraQuant's backend is a TurboQuant one), read when
    a test runs: vLLM is not imported at collection."""
    (layout,) = tq_attn.TurboQuantAttentionBackend.supported_kv_cache_layouts()
    return layout


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def allocate() -> tuple[dict[str, torch.Tensor], Any]:
    spec = iface.FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=HS, dtype=torch.uint8,
                                   kv_quant_mode=iface.KVQuantMode.ULTRAQUANT_4BIT)
    spec = dataclasses.replace(spec, state_content_bytes=uqf.slot_size(HS))  # UltraQuantAttentionBackend.customize_spec
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


def inputs(layer: int, kv: int, tokens: torch.Tensor) -> torch.Tensor:
    """[tokens, H, HS]: every (layer, side, token, head, dim) its own value, each 32-group its own size."""
    t = tokens.reshape(-1, 1, 1).float()
    h = torch.arange(H).reshape(1, -1, 1).float()
    d = torch.arange(HS).reshape(1, 1, -1).float()
    return torch.sin(0.41 * d + 1.7 * t + 0.6 * h + 2.3 * layer + kv) * 2.0 ** ((t + h + d // 32 + kv) % 7 - 3)


def encoded(layer: int, kv: int, tokens: torch.Tensor) -> uq_reference.UltraQuantEncoded:
    return uq_reference.ultraquant_encode(inputs(layer, kv, tokens), rotate=kv == 0)  # K is Hadamard-rotated at store


def cells(view: torch.Tensor) -> torch.Tensor:
    return view.transpose(1, 2)  # the logical [B, H, N, C] view of an LBNHC page: [B, N, H, slot]


def write(kv: dict[str, torch.Tensor], slots: torch.Tensor) -> None:
    """Slots of tokens SLOTS, assembled at format.py's offsets, each at its (block, position, head)."""
    for layer in range(L):
        k, v = encoded(layer, 0, SLOTS), encoded(layer, 1, SLOTS)
        slot = torch.zeros(len(SLOTS), H, uqf.slot_size(HS), dtype=torch.uint8)
        for start, data in ((uqf.k_codes_offset(HS), k.codes_packed), (uqf.k_scales_offset(HS), k.scale_bytes),
                            (uqf.v_codes_offset(HS), v.codes_packed), (uqf.v_scales_offset(HS), v.scale_bytes)):
            slot[..., start:start + data.shape[-1]] = data
        page = cells(kv[f"attn.{layer}"])
        for t, s in enumerate(slots.tolist()):
            page[s // N, s % N] = slot[t]


def test_the_engines_slot_is_the_specs_row() -> None:
    kv, _ = allocate()
    assert tuple(kv["attn.0"].shape) == (B, H, N, uqf.slot_size(HS)) and cells(kv["attn.0"]).is_contiguous()
    fields = {f.name: f for f in SPEC.parts[0].fields}
    assert [fields[n].offset for n in ("key", "key_scale", "values", "value_scale")] == [
        uqf.k_codes_offset(HS), uqf.k_scales_offset(HS), uqf.v_codes_offset(HS), uqf.v_scales_offset(HS)]
    assert SPEC.parts[0].row_bytes == uqf.slot_size(HS)


def test_the_engines_cache_moves_both_ways() -> None:
    kv, config = allocate()
    write(kv, SLOTS)
    (group,) = kvgen.from_vllm(kv, config, _layout(), engine_version="0.33.0")
    assert (group.detection.layout, group.connector.memory.name) == ("vllm_ultraquant_4bit", "kv_planes")
    obj = MemoryObj(torch.zeros(tuple(group.connector.get_shape(len(SLOTS), group.kvcaches)), dtype=torch.uint8))
    group.connector.from_gpu(obj, 0, len(SLOTS), kvcaches=group.kvcaches, slot_mapping=SLOTS)
    fresh, fresh_config = allocate()
    oracle, _ = allocate()
    write(oracle, AGAIN)
    (target,) = kvgen.from_vllm(fresh, fresh_config, _layout(), engine_version="0.33.0")
    target.connector.to_gpu(obj, 0, len(SLOTS), kvcaches=target.kvcaches, slot_mapping=AGAIN)
    for layer in range(L):
        assert torch.equal(fresh[f"attn.{layer}"], oracle[f"attn.{layer}"])  # every byte, moved and not moved


def decode(spec: Spec, kv: dict[str, torch.Tensor], layer: int, slot: int) -> list[torch.Tensor]:
    """K and V at (layer, slot), [H, HS], from the spec's arithmetic alone: each value's nibble
    (packed_value) times 2 ** (its scale's byte - 127), the scale being scale_index's."""
    planes = {p.name: p for p in spec.moved_planes()}
    leaf = cells(kv[f"attn.{layer}"])  # the spec's memory order [B, N, H, C]
    ext = {"L": L, "B": B, "N": N, "H": H, "C": leaf.shape[-1]}
    out = []
    for data, scale in (("key", "key_scale"), ("values", "value_scale")):
        got = torch.zeros(H, HS)
        for h in range(H):
            for c in range(HS):
                where = {"l": layer, "slot": slot, "h": h}
                unit, shift = packed_value(planes[data].field, c)
                _, index, _ = plane_address(spec, planes[data], {**where, "c": unit}, ext, 1)
                bits = int(leaf[index]) >> shift & 0xF
                s = scale_index(planes[data].field, planes[scale].field, c)
                _, at, _ = plane_address(spec, planes[scale], {**where, "c": s}, ext, 1)
                got[h, c] = E2M1[bits & 7] * (-1 if bits & 8 else 1) * 2.0 ** (int(leaf[at]) - 127)
        out.append(got)
    return out


def dequantizes_as_vllm(spec: Spec, kv: dict[str, torch.Tensor]) -> bool:
    for layer, t in ((0, 0), (1, 6)):
        token = SLOTS[t:t + 1]
        want = [uq_reference.ultraquant_dequant(encoded(layer, side, token), HS)[0] for side in (0, 1)]
        if not all(torch.equal(g, w) for g, w in zip(decode(spec, kv, layer, int(SLOTS[t])), want, strict=True)):
            return False
    return True


def _mutant(spec: Spec, name: str, **changes: Any) -> Spec:
    part = spec.parts[0]
    fields = tuple(dataclasses.replace(f, **changes) if f.name == name else f for f in part.fields)
    return dataclasses.replace(spec, parts=(dataclasses.replace(part, fields=fields),))


def test_the_specs_arithmetic_dequantizes_as_vllm_and_its_mutants_do_not() -> None:
    kv, _ = allocate()
    write(kv, SLOTS)
    assert dequantizes_as_vllm(SPEC, kv)
    assert not dequantizes_as_vllm(_mutant(SPEC, "key", packing=Packing.HIGH_FIRST), kv)  # a nibble swap
    assert not dequantizes_as_vllm(_mutant(SPEC, "value_scale", group=64, count=2), kv)  # a scale of 64 values
