"""vLLM 0.33's quantized caches (kv_quant_mode) as the oracle: INT8, FP8 and INT4_PER_TOKEN_HEAD
(Triton backend, inline fp32 scales) and NVFP4 (FlashInfer head slots, packed fp4 with fp8 block
scales), moved by kvgen both ways with their packed bytes as they are.

Caches are made by vLLM's functions (FullAttentionSpec with kv_quant_mode, the backend's
customize_spec, get_kv_cache_config_from_groups, allocate_kv_cache). Values are written where
vLLM's own kernels read them: for the Triton modes through the K/V views of
`_pth_key_value_caches` and the scale views of `TritonAttentionImpl._ensure_scale_caches`, packing
int4 with vLLM's `pack_int4_nibbles`; for NVFP4 through `nvfp4_split_data_scale` on each side of
FlashInfer's `_nvfp4_kv_views` (compiled from vLLM's source file, whose module does not import
without FlashInfer), under LBHNC (head-major cells) and LBNHC (NHD: slot-major cells, K and V the
page's halves). (vLLM's write kernels are CUDA or Triton; FlashInfer is not installed here, so its
customize_spec is restated from its two lines, with vLLM's own `nvfp4_kv_cache_full_dim`.)
Every value encodes its layer, K/V side, slot, head and position; every scale its layer, side, slot
and head. kvgen stores the slots into a kv_planes object, whose regions must hold each token's bytes
and scales; loads them into a fresh vLLM cache, read back at vLLM's offsets; and the spec's own
address arithmetic (kvgen.oracle.address) must decode every value and find its scale where vLLM's
kernels do. A nibble swap, a scale read at the data's bytes or a scale taken from another token,
each made by mutating the spec, fails those checks.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness import builtin_library, vllm_module

iface = vllm_module("vllm.v1.kv_cache_interface")


torch_utils = vllm_module("vllm.utils.torch_utils")
triton_attn = vllm_module("vllm.v1.attention.backends.triton_attn")
int4 = vllm_module("vllm.v1.attention.ops.int4_per_token_head")
planning = vllm_module("vllm.v1.core.kv_cache_planning")
worker = vllm_module("vllm.v1.worker.utils")
vllm_layouts = vllm_module("vllm.v1.kv_cache_layout")

import kvgen  # noqa: E402
from kvgen import generated  # noqa: E402
from kvgen.integrations.detect import AmbiguousLayout, NoLayout, detect  # noqa: E402
from kvgen.oracle.address import packed_value, plane_address, scale_index  # noqa: E402
from kvgen.oracle.facts.planes import PARTS_FACTS  # noqa: E402
from kvgen.oracle.facts.table import EngineGeometry as Geometry  # noqa: E402
from kvgen.oracle.reference import Span  # noqa: E402
from kvgen.oracle.reference import planes as reference  # noqa: E402
from kvgen.runtime import KVLayoutError, MemoryObj  # noqa: E402
from kvgen.spec.model import Dim, Packing, Spec  # noqa: E402

LIBRARY = builtin_library()
#: H == N, so a spec that reads a (head, slot) cell as (slot, head) still fits the tensors and
#: only the values can tell.
L, B, N, H, HS = 2, 5, 4, 4, 128
SLOTS = [17, 3, 8, 9, 10, 11, 0, 19, 6]


@dataclasses.dataclass(frozen=True)
class Mode:
    spec: str
    dtype: torch.dtype
    layout: str
    #: Bits per value and values per scale.
    bits: int
    group: int
    #: The KVQuantMode.
    quant: str


MODES = {
    "INT8_PER_TOKEN_HEAD": Mode("vllm_int8_per_token_head", torch.int8, "LBNHC", 8, HS, "INT8_PER_TOKEN_HEAD"),
    "FP8_PER_TOKEN_HEAD": Mode("vllm_fp8_per_token_head", torch.uint8, "LBNHC", 8, HS, "FP8_PER_TOKEN_HEAD"),
    "INT4_PER_TOKEN_HEAD": Mode("vllm_int4_per_token_head", torch.uint8, "LBNHC", 4, HS, "INT4_PER_TOKEN_HEAD"),
    "NVFP4": Mode("vllm_nvfp4", torch.uint8, "LBHNC", 4, 16, "NVFP4"),
    "NVFP4_NHD": Mode("vllm_nvfp4_nhd", torch.uint8, "LBNHC", 4, 16, "NVFP4"),  # FlashInfer's fa2 path (SM80/90/120)
}
NVFP4 = ("NVFP4", "NVFP4_NHD")


def _vllm_function(module: str, name: str, **scope: Any) -> Any:
    """Function `name` of a vLLM module that does not import here, compiled from vLLM's own source
    file with `scope` as the globals it reads."""
    origin = importlib.util.find_spec(module).origin
    tree = ast.parse(open(origin).read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {"torch": torch, **scope}
    exec(compile(ast.Module([node], type_ignores=[]), origin, "exec"), namespace)  # noqa: S102 - vLLM's code
    return namespace[name]


@functools.cache
def nvfp4_kv_views() -> Any:
    """FlashInfer's views of an NVFP4 page: ((K data, V data), (K scales, V scales), "HND" or "NHD").
    Made when a test first asks (finding the module imports vLLM's packages)."""
    return _vllm_function("vllm.v1.attention.backends.flashinfer", "_nvfp4_kv_views",
                          _KVPair=tuple, nvfp4_split_data_scale=torch_utils.nvfp4_split_data_scale)


def _vllm_config(layout: str) -> Any:
    """The VllmConfig fields get_kv_cache_config_from_groups reads (a whole VllmConfig needs a model)."""
    cache = SimpleNamespace(get_resolved_kv_cache_layout=lambda: vllm_layouts.KVCacheLayout[layout],
                            prefix_cache_retention_interval=None, num_gpu_blocks_override=B)
    return SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None), cache_config=cache)


def attention_spec(name: str) -> Any:
    mode = MODES[name]
    spec = iface.FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=HS, dtype=mode.dtype,
                                   kv_quant_mode=iface.KVQuantMode[mode.quant])
    if name in NVFP4:  # FlashInferBackend.customize_spec
        return dataclasses.replace(spec, num_head_slots=2 * H,
                                   state_content_bytes=torch_utils.nvfp4_kv_cache_full_dim(HS))
    return triton_attn.TritonAttentionBackend.customize_spec(spec)


def allocate(name: str) -> tuple[dict[str, torch.Tensor], Any]:
    """vLLM's layer name -> view dict and its KVCacheConfig."""
    layout = MODES[name].layout
    group = iface.KVCacheGroupSpec([f"attn.{i}" for i in range(L)], attention_spec(name))
    config = planning.get_kv_cache_config_from_groups(_vllm_config(layout), [group], 1 << 30)
    config.kv_cache_layout = layout
    return worker.allocate_kv_cache(config, torch.device("cpu"), vllm_layouts.KVCacheLayout[layout]), config


def engine_cache(name: str) -> tuple[list[torch.Tensor], list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """vLLM's per-layer views of a fresh cache (zeros), in layer order, and per layer its data
    and scale views (made once, as the backend does on first use: Triton sets its scales to 1)."""
    kv, _ = allocate(name)
    views = [kv[f"attn.{i}"] for i in range(L)]
    for v in views:
        v.zero_()
    return views, [engine_views(name, v) for v in views]


def engine_views(name: str, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per side (K, V): vLLM's data bytes and scale bytes, each [B, N, H, bytes]."""
    if name in NVFP4:
        (k, v), (k_scale, v_scale), order = nvfp4_kv_views()(kv_cache, H)
        assert order == ("NHD" if MODES[name].layout == "LBNHC" else "HND")
        if order == "HND":  # [B, H, N, bytes]
            k, v, k_scale, v_scale = (t.transpose(1, 2) for t in (k, v, k_scale, v_scale))
        return [(k, k_scale.view(torch.uint8)), (v, v_scale.view(torch.uint8))]
    impl = SimpleNamespace(_k_scale_cache=None, _v_scale_cache=None)
    triton_attn.TritonAttentionImpl._ensure_scale_caches(impl, kv_cache)  # type: ignore[arg-type]
    padded = kv_cache.shape[-1] // 2
    k, v = kv_cache.transpose(1, 2).split(padded, dim=-1)  # as _pth_key_value_caches
    data = padded - 4
    return [(k[..., :data].view(torch.uint8), impl._k_scale_cache.unsqueeze(-1).view(torch.uint8)),
            (v[..., :data].view(torch.uint8), impl._v_scale_cache.unsqueeze(-1).view(torch.uint8))]


def value_of(layer: int, kv: int, slot: int, h: int, c: int, bits: int) -> int:
    """Value c of (layer, side, slot, head): its coordinates, to the value's width."""
    return (c + 3 * h + 5 * slot + 7 * kv + 11 * layer) % (1 << bits)


def scale_bytes(name: str, layer: int, kv: int, slot: int, h: int) -> torch.Tensor:
    if name in NVFP4:  # 8 fp8 block scales: each its group, head, slot, side and layer
        return torch.tensor([(g + 8 * h + 37 * slot + 101 * kv + 7 * layer) % 256 for g in range(HS // 16)],
                            dtype=torch.uint8)
    return torch.tensor([float(1 + layer * 10000 + kv * 1000 + slot * 10 + h)]).view(torch.uint8)


def data_bytes(name: str, layer: int, kv: int, slot: int, h: int) -> torch.Tensor:
    bits = MODES[name].bits
    vals = torch.tensor([value_of(layer, kv, slot, h, c, bits) for c in range(HS)])
    if bits == 8:
        return vals.to(torch.uint8)
    # INT4: vLLM's pack_int4_nibbles (value 2j low); NVFP4: low nibble first (break_fp4_bytes).
    return int4.pack_int4_nibbles(vals[0::2], vals[1::2]).to(torch.uint8)


def write(name: str, sides: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
    for layer, per_side in enumerate(sides):
        for kv, (data, scale) in enumerate(per_side):
            for slot in range(B * N):
                for h in range(H):
                    data[slot // N, slot % N, h] = data_bytes(name, layer, kv, slot, h)
                    scale[slot // N, slot % N, h] = scale_bytes(name, layer, kv, slot, h)


def handed(name: str, views: list[torch.Tensor]) -> list[torch.Tensor]:
    """The leaves in the spec's memory order: vLLM hands over [B, H, N, C]; LBNHC stores [B, N, H, C]."""
    return [v.transpose(1, 2) if MODES[name].layout == "LBNHC" else v for v in views]


def regions(name: str, obj: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_planes: per layer each plane's dense [KV, T, H, bytes] region, each at a multiple of 16."""
    sizes = [len(data_bytes(name, 0, 0, 0, 0)), len(scale_bytes(name, 0, 0, 0, 0))]
    out, at = [], 0
    for size in sizes:
        n = 2 * tokens * H * size
        out.append(obj[:, at:at + n].reshape(L, 2, tokens, H, size))
        at += -(-n // 16) * 16
    return out[0], out[1]


def check_object(name: str, obj: torch.Tensor, slots: list[int]) -> None:
    data, scale = regions(name, obj, len(slots))
    for layer in range(L):
        for kv in range(2):
            for t, slot in enumerate(slots):
                for h in range(H):
                    assert torch.equal(data[layer, kv, t, h], data_bytes(name, layer, kv, slot, h)), (layer, kv, t, h)
                    assert torch.equal(scale[layer, kv, t, h], scale_bytes(name, layer, kv, slot, h)), (layer, kv, t, h)


def store(name: str, views: list[torch.Tensor], spec: Spec | None = None) -> MemoryObj:
    """The kv_planes object of SLOTS: by the generated connector, or by the reference interpreter
    reading the cache as `spec` says."""
    connector = generated.get(MODES[name].spec, "kv_planes")()
    leaves = handed(name, views)
    obj = MemoryObj(torch.zeros(connector.get_shape(len(SLOTS), leaves), dtype=torch.uint8))
    if spec is None:
        connector.from_gpu(obj, 0, len(SLOTS), kvcaches=leaves, slot_mapping=torch.tensor(SLOTS))
    else:
        ext = {"L": L, "KV": 2, "B": B, "N": N, "H": H, "C": leaves[0].shape[-1] // 2}
        reference.store(spec, LIBRARY["kv_planes"], ext, leaves, obj.tensor, Span(SLOTS, 0, len(SLOTS)))
    return obj


@pytest.mark.parametrize("name", MODES)
def test_the_engines_cache_moves_both_ways_with_its_scales(name: str) -> None:
    views, sides = engine_cache(name)
    write(name, sides)
    obj = store(name, views)
    check_object(name, obj.tensor, SLOTS)
    fresh, fresh_sides = engine_cache(name)
    before = [v.clone() for v in fresh]
    connector = generated.get(MODES[name].spec, "kv_planes")()
    connector.to_gpu(obj, 0, len(SLOTS), kvcaches=handed(name, fresh), slot_mapping=torch.tensor(SLOTS))
    for layer, per_side in enumerate(fresh_sides):
        untouched = engine_views(name, before[layer]) if name in NVFP4 else None
        for kv, (data, scale) in enumerate(per_side):
            for slot in range(B * N):
                b, n = slot // N, slot % N
                for h in range(H):
                    if slot in SLOTS:
                        assert torch.equal(data[b, n, h], data_bytes(name, layer, kv, slot, h)), (layer, kv, slot, h)
                        assert torch.equal(scale[b, n, h], scale_bytes(name, layer, kv, slot, h)), (layer, kv, slot, h)
                    else:  # as vLLM left it: zeros, and Triton's scales of 1
                        old_scale = untouched[kv][1][b, n, h] if untouched else _one()
                        assert not data[b, n, h].any() and torch.equal(scale[b, n, h], old_scale), (layer, slot, h)


def _one() -> torch.Tensor:
    return torch.tensor([1.0]).view(torch.uint8)


def decode(spec: Spec, views: list[torch.Tensor], at: tuple[int, int, int, int]) -> tuple[list[int], list[int]]:
    """Values of one (layer, side, slot, head) and, for each, the first byte of its scale,
    found by the spec's own address arithmetic alone."""
    layer, kv, slot, h = at
    values, scale = spec.moved_planes()
    leaf = handed(spec_mode(spec), views)[layer].view(torch.uint8)
    ext = {"L": L, "KV": 2, "B": B, "N": N, "H": H, "C": leaf.shape[-1] // 2}
    coords = {"l": layer, "kv": kv, "slot": slot, "h": h}
    out, scales = [], []
    for c in range(values.field.count):
        unit, shift = packed_value(values.field, c)
        _, index, _ = plane_address(spec, values, {**coords, "c": unit}, ext, 1)
        out.append((int(leaf[index]) >> shift) & ((1 << values.field.bits) - 1))
        _, index, _ = plane_address(spec, scale, {**coords, "c": scale_index(values.field, scale.field, c)}, ext, 1)
        scales.append(int(leaf[index]))
    return out, scales


def spec_mode(spec: Spec) -> str:
    return next(n for n, m in MODES.items() if m.spec == spec.name)


def decodes_as_the_engine(spec: Spec, views: list[torch.Tensor]) -> bool:
    name = spec_mode(spec)
    for layer, kv, slot, h in ((0, 0, 0, 0), (1, 1, 13, 2), (1, 0, 19, 3), (0, 1, 6, 1)):
        values, scales = decode(spec, views, (layer, kv, slot, h))
        mode = MODES[name]
        if values != [value_of(layer, kv, slot, h, c, mode.bits) for c in range(HS)]:
            return False
        first = scale_bytes(name, layer, kv, slot, h)
        per = len(first) // (HS // mode.group)  # bytes per scale
        if scales != [int(first[(c // mode.group) * per]) for c in range(HS)]:
            return False
    return True


@pytest.mark.parametrize("name", MODES)
def test_the_specs_address_arithmetic_decodes_what_the_engine_wrote(name: str) -> None:
    views, sides = engine_cache(name)
    write(name, sides)
    assert decodes_as_the_engine(LIBRARY[MODES[name].spec], views)


def _with_fields(spec: Spec, **changes: Any) -> Spec:
    part = spec.parts[0]
    return dataclasses.replace(spec, parts=(dataclasses.replace(part, **changes),))


@pytest.mark.parametrize("name", ["INT4_PER_TOKEN_HEAD", *NVFP4])
def test_a_nibble_swap_in_the_spec_fails(name: str) -> None:
    views, sides = engine_cache(name)
    write(name, sides)
    spec = LIBRARY[MODES[name].spec]
    values, scale = spec.parts[0].fields
    swapped = _with_fields(spec, fields=(dataclasses.replace(values, packing=Packing.HIGH_FIRST), scale))
    assert not decodes_as_the_engine(swapped, views)


def test_scales_read_at_the_datas_bytes_fail() -> None:
    """INT8: the spec's fields in the other order (scale first) moves data bytes as the scale."""
    name = "INT8_PER_TOKEN_HEAD"
    views, sides = engine_cache(name)
    write(name, sides)
    spec = LIBRARY[MODES[name].spec]
    values, scale = spec.parts[0].fields
    swapped = _with_fields(spec, fields=(dataclasses.replace(values, offset=4), dataclasses.replace(scale, offset=0)))
    check_object(name, store(name, views, LIBRARY[MODES[name].spec]).tensor, SLOTS)  # the reference, as the spec says
    with pytest.raises(AssertionError):
        check_object(name, store(name, views, swapped).tensor, SLOTS)
    assert not decodes_as_the_engine(swapped, views)


#: NVFP4 cells read in the other order: slot-major for LBHNC, head-major for LBNHC (its [N, 2H] page
#: dims read as [H, 2N]).
OTHER_CELLS = {"NVFP4": (Dim(("B",)), Dim(("KV", "N")), Dim(("H",)), Dim(("C",))),
               "NVFP4_NHD": (Dim(("B",)), Dim(("H",)), Dim(("KV", "N")), Dim(("C",)))}


@pytest.mark.parametrize("name", NVFP4)
def test_a_scale_taken_from_another_token_fails(name: str) -> None:
    """NVFP4: cells read in the other order (H == N, so the shapes agree) give each token another
    token's data and scales."""
    views, sides = engine_cache(name)
    write(name, sides)
    spec = LIBRARY[MODES[name].spec]
    transposed = _with_fields(spec, dims=OTHER_CELLS[name])
    with pytest.raises(AssertionError):
        check_object(name, store(name, views, transposed).tensor, SLOTS)
    assert not decodes_as_the_engine(transposed, views)


@pytest.mark.parametrize("name", MODES)
def test_the_fact_tables_shapes_are_vllms(name: str) -> None:
    """kvgen.oracle.facts.quant states each cache's memory-order shape from vLLM's sources; the
    live cache vLLM allocates has it."""
    views, _ = engine_cache(name)
    fact = PARTS_FACTS[MODES[name].spec]
    assert tuple(handed(name, views)[0].shape) == fact.parts[0].shape(Geometry(L=L, B=B, N=N, H=H, C=HS))
    assert str(views[0].dtype).removeprefix("torch.") == fact.parts[0].dtype


@pytest.mark.parametrize("name", MODES)
def test_from_vllm_picks_the_quantized_spec_from_the_kv_cache_spec(name: str) -> None:
    """kvgen.from_vllm reads kv_quant_mode from the group's KVCacheSpec: the connector is the
    mode's spec with kv_planes, and it moves the engine's bytes and scales."""
    kv, config = allocate(name)
    views = [kv[f"attn.{i}"] for i in range(L)]
    for v in views:
        v.zero_()
    write(name, [engine_views(name, v) for v in views])
    (group,) = kvgen.from_vllm(kv, config, engine_version="0.33.0")
    assert (group.detection.layout, group.connector.memory.name) == (MODES[name].spec, "kv_planes")
    obj = MemoryObj(torch.zeros(group.connector.get_shape(len(SLOTS), group.kvcaches), dtype=torch.uint8))
    group.connector.from_gpu(obj, 0, len(SLOTS), kvcaches=group.kvcaches, slot_mapping=torch.tensor(SLOTS))
    check_object(name, obj.tensor, SLOTS)


HINTS = {"engine": "vllm", "engine_version": "0.33.0", "num_kv_heads": H, "block_size": N}


@pytest.mark.parametrize("name", ["INT8_PER_TOKEN_HEAD", "FP8_PER_TOKEN_HEAD"])
def test_a_cache_readable_two_ways_is_refused_without_the_quantization(name: str) -> None:
    """A Triton per-token-head cache of head size 128 has the tensors of a plain LBNHC cache of
    head size 132: without kv_quant_mode (or kv_cache_dtype) detection names both and the hint."""
    views, _ = engine_cache(name)
    with pytest.raises(AmbiguousLayout, match="kv_quant_mode") as info:
        detect(views, kv_layout="LBNHC", **HINTS)
    assert info.value.candidates[MODES[name].spec]["kv_quant_mode"] == name
    assert info.value.candidates["vllm_lbnhc"]["kv_quant_mode"] == "NONE"
    assert detect(views, kv_layout="LBNHC", kv_quant_mode=iface.KVQuantMode[name], **HINTS).layout == MODES[name].spec
    assert detect(views, kv_layout="LBNHC", kv_cache_dtype=name.lower(), **HINTS).layout == MODES[name].spec
    assert detect(views, kv_layout="LBNHC", kv_quant_mode="NONE", **HINTS).layout == "vllm_lbnhc"


def test_hints_that_disagree_on_the_quantization_are_refused() -> None:
    views, _ = engine_cache("NVFP4")
    with pytest.raises(KVLayoutError, match="hints disagree: kv_quant_mode is 'NVFP4', kv_cache_dtype means"):
        detect(views, kv_quant_mode="NVFP4", kv_cache_dtype="fp8_per_token_head", **HINTS)
    with pytest.raises(NoLayout, match="kv_quant_mode='TURBOQUANT_K8V4'"):
        detect(views, kv_layout="LBHNC", kv_quant_mode="TURBOQUANT_K8V4", **HINTS)



@pytest.mark.parametrize("name", NVFP4)
def test_the_nvfp4_pages_are_told_apart_by_their_strides_and_need_the_quantization(name: str) -> None:
    """vLLM's NVFP4 pages under LBHNC and under LBNHC are one logical [B, 2H, N, C] view whose strides
    differ: detection gives each its spec, and refuses both when the hints say the cache is unquantized."""
    views, _ = engine_cache(name)
    layout = MODES[name].layout
    assert detect(views, kv_layout=layout, **HINTS).layout == MODES[name].spec
    assert detect(views, kv_layout=layout, kv_cache_dtype="nvfp4", **HINTS).layout == MODES[name].spec
    with pytest.raises(NoLayout):
        detect(views, kv_layout=layout, kv_quant_mode="NONE", **HINTS)
