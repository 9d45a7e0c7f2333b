"""Connectors for a vLLM 0.33 cache, from what vLLM itself declares: the per-layer views
`allocate_kv_cache` returns (a dict layer name -> logical [B, H, N, C] view), the
`KVCacheConfig` (its groups and their `KVCacheSpec`s) and the resolved `KVCacheLayout`
(`kv_cache_config.kv_cache_layout` / `cache_config.kv_cache_layout`). Nothing is read from
shapes alone: the layout's name, the heads, the block size and MLA-or-not come from vLLM's
objects, and detection checks the views against them.

One connector per KV cache group: groups overlay the same bytes (a block belongs to one group
at a time), so each connector sees its own group's layers only, and its alias checks still
refuse layers of one group that share memory. Keep the manager views (`allocate_kv_cache`
without kernel block sizes): views re-cut into smaller kernel blocks are refused, their block
size differs from the group's.

ROCm AITER's SHUFFLE cells (rocm_aiter_fa.py, `kv_cache_layout="SHUFFLE"` when
VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT is set) are declared by passing `layout="SHUFFLE"`: vLLM publishes
them as two head slots of num_kv_heads * head_size values (customize_spec), as it publishes ROCM_ATTN's
cells, whose bytes differ, so the word decides, never the views. Each layer's (side, block) page is
then K [H, C/x, N, x] and V [H, N/x, C, x], x = 16 // the element size (reshape_and_cache_shuffle_kernel):
the bytes of SGLang's vectorized_5d pool, so from_vllm hands each side over as those 5-D tiles (free
views) to the same specs (sglang_layouts.TILED_SPECS).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kvgen.errors import KVLayoutError
from kvgen.integrations.detect import Detection, _package, detect
from kvgen.integrations.hints import engine_version as release_of
from kvgen.integrations.quant import packs_k_and_v
from kvgen.integrations.sglang.layouts import TILED_SPECS
from kvgen.versions import version_in

__all__ = ["Pairing", "VllmGroup", "from_vllm"]


@dataclass(frozen=True)
class VllmGroup:
    """One KV cache group, ready to move: its layers (in the group's order), their views in
    memory order (pass them as `kvcaches=`), the detection and the connector."""

    index: int
    layer_names: tuple[str, ...]
    kvcaches: list[Any]
    detection: Detection
    connector: Any


@dataclass(frozen=True)
class Pairing:
    """What each group's connector pairs the cache with: the memory object (`kv_object`; default
    kv_2ltd, kv_mla for MLA, kv_planes for a quantized cache) and the generated package, a module
    or its name, whose specs detect the cache and whose module connects it (default kvgen's own)."""

    kv_object: str | None = None
    package: ModuleType | str | None = None


def _layout_name(layout: Any, kv_cache_config: Any) -> str:
    if layout is None:
        layout = getattr(kv_cache_config, "kv_cache_layout", None)
    if layout is None:
        raise KVLayoutError("from_vllm: no KVCacheLayout given and kv_cache_config.kv_cache_layout is unset; pass "
                            "vLLM's resolved layout (cache_config.kv_cache_layout or KVCacheLayout.<name>)")
    return str(getattr(layout, "name", layout))


def _spec_hints(spec: Any, group: int) -> dict[str, Any]:
    """The facts of a group's KVCacheSpec as detection hints; refuses what kvgen has no spec for."""
    kind = type(spec).__name__
    if hasattr(spec, "kv_cache_specs"):
        raise KVLayoutError(f"from_vllm: group {group} has per-layer specs ({kind}); kvgen moves groups whose "
                            "layers share one KVCacheSpec")
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    tokens = getattr(spec, "tokens_per_state", 1)
    _refuse_packed_cells(spec, kind, group, quant)
    mla = kind.startswith("MLA") or getattr(spec, "head_size_v", None) == 0
    if quant != "NONE":  # a quantized cell: its C is not the head size; the mode picks the spec
        hints = {"num_kv_heads": spec.num_kv_heads, "block_size": spec.block_size, "use_mla": mla,
                 "dtype": str(spec.dtype).removeprefix("torch."), "kv_quant_mode": quant}
        if packs_k_and_v(quant):  # one slot holds K and V: whether MLA says nothing of the planes
            del hints["use_mla"]
        return hints
    if not mla and spec.head_size_v != spec.head_size:
        raise KVLayoutError(f"from_vllm: group {group} has K head size {spec.head_size} and V head size "
                            f"{spec.head_size_v}; the vLLM 0.33 layouts pack K and V halves of one width")
    # tokens_per_state: a fraction stores each token as several states (Whisper block pooling), in
    # blocks of block_size tokens; only a spec of that many slots per token is that cache.
    return {"num_kv_heads": spec.num_kv_heads, "block_size": spec.block_size, "head_size": spec.head_size,
            "use_mla": mla, "dtype": str(spec.dtype).removeprefix("torch."), "tokens_per_state": tokens}


def _refuse_packed_cells(spec: Any, kind: str, group: int, quant: str) -> None:
    """Refuses a KVCacheSpec whose cells kvgen has no layout for: packed head slots or state bytes
    of an unquantized cache, or several tokens per state. A fraction of a token per state (Whisper
    block pooling) is an unquantized, unpacked cache of several states per token."""
    packed = {k: getattr(spec, k, None) for k in ("num_head_slots", "state_content_bytes")}
    tokens = getattr(spec, "tokens_per_state", 1)
    unpacked = all(v is None for v in packed.values())
    pooled = tokens < 1 and quant == "NONE" and unpacked
    if (not unpacked and quant == "NONE") or (tokens != 1 and not pooled):
        raise KVLayoutError(f"from_vllm: group {group} ({kind}) packs its cells (kv_quant_mode={quant}, "
                            f"tokens_per_state={tokens}, {packed}); kvgen has no layout for that cell yet")


def _refuse_soa_pages(quant: str, group: int) -> None:
    """vLLM 0.33's TurboQuant backend stores its pages SoA where FlyDSL runs (ROCm gfx950:
    TurboQuantAttentionImpl sets `_soa_store = is_flydsl_available()`): each block keeps every
    slot's key and value bytes first and the norms, scales and zeros after them as arrays of their
    own, in an allocation of the same size. kvgen's TurboQuant specs are the per-slot pages every
    other platform stores, so such a cache is refused, never read as those; vLLM's own switch
    decides, as nothing in the cache or its KVCacheSpec tells the two apart."""
    if not quant.startswith("TURBOQUANT_"):
        return
    try:  # vLLM: only for a TurboQuant cache (kvgen imports without vLLM)
        from vllm.v1.attention.ops.flydsl_turboquant_decode import is_flydsl_available
    except ImportError as exc:
        raise KVLayoutError(f"from_vllm: group {group} (kv_quant_mode={quant}): vLLM's FlyDSL switch does not "
                            f"import here ({exc}), so whether its pages are per-slot or SoA is unknown") from None
    if is_flydsl_available():
        raise KVLayoutError(f"from_vllm: group {group} (kv_quant_mode={quant}): with FlyDSL (ROCm gfx950) vLLM "
                            "stores TurboQuant pages SoA (each block's data, then its norms, scales and zeros); "
                            "kvgen has specs for the per-slot pages only")


def from_vllm(kv_caches: Mapping[str, Any], kv_cache_config: Any, layout: Any = None, *,
              engine_version: str | None = None, pairing: Pairing = Pairing(),
              **connector_args: Any) -> list[VllmGroup]:
    """A ready connector per KV cache group of a vLLM cache.

    `kv_caches`: layer name -> view, as vLLM's `allocate_kv_cache` returns (the manager views);
    `kv_cache_config`: vLLM's `KVCacheConfig`; `layout`: the resolved `KVCacheLayout` (member or
    name; default `kv_cache_config.kv_cache_layout`), or "SHUFFLE" for ROCm AITER's shuffled cells
    (rocm_aiter_ops.is_shuffle_kv_cache_enabled(); under LHBNC or LBHNC);
    `engine_version`: default the installed vllm's; `pairing`: the memory object to pair with and
    the generated package (`Pairing`);
    `connector_args` (device, use_gpu, staging_bytes, backend) go to each connector.
    """
    package = pairing.package
    name = _layout_name(layout, kv_cache_config)
    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()))
    if not groups:
        raise KVLayoutError("from_vllm: the KVCacheConfig has no kv_cache_groups (an attention-free model?)")
    out = []
    for index, group in enumerate(groups):
        names = tuple(group.layer_names)
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise KVLayoutError(f"from_vllm: group {index} names layers {missing} that kv_caches does not hold "
                                f"(it holds {sorted(kv_caches)[:8]}...)")
        if name.upper() == "SHUFFLE":
            out.append(_shuffle_group(index, names, [kv_caches[n] for n in names], group.kv_cache_spec,
                                      (engine_version, pairing, connector_args)))
            continue
        hints = _spec_hints(group.kv_cache_spec, index)
        _refuse_soa_pages(hints.get("kv_quant_mode", "NONE"), index)
        views = [kv_caches[n] for n in names]
        found = detect(views, package=package, engine="vllm", engine_version=engine_version, kv_layout=name,
                       num_layers=len(names), **hints)
        quantized = hints.get("kv_quant_mode") is not None  # packed values and scales: kvgen's plane regions
        obj = pairing.kv_object or ("kv_planes" if quantized else "kv_mla" if hints["use_mla"] else "kv_2ltd")
        connector = _package(package).get(found.layout, obj)(**connector_args)
        out.append(VllmGroup(index, names, found.view(views), found, connector))
    return out


def _shuffle_spec(spec: Any, index: int) -> tuple[int, int, int, str]:
    """(heads, head size, x, the spec) of a group whose KVCacheSpec AITER's customize_spec made: two
    head slots of num_kv_heads * head_size values each, K and V of one head size."""
    dtype = str(getattr(spec, "dtype", None)).removeprefix("torch.")
    heads, size = int(spec.num_kv_heads), int(spec.head_size)
    item = {"bfloat16": 2, "float16": 2, "uint8": 1}.get(dtype)
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    if (getattr(spec, "num_head_slots", None), getattr(spec, "state_content_bytes", None)) != (
            2, heads * size * (item or 0)) or spec.head_size_v != size or quant not in ("NONE", "FP8_PER_TENSOR"):
        raise KVLayoutError(f"from_vllm: group {index} ({type(spec).__name__}, {dtype}, kv_quant_mode={quant}) is not "
                            "ROCm AITER's SHUFFLE cache: customize_spec makes it two head slots of num_kv_heads * "
                            "head_size bfloat16, float16 or fp8 (uint8) values, K and V of one head size")
    return heads, size, 16 // item, TILED_SPECS[dtype]


def _shuffle_sides(view: Any, heads: int, size: int, x: int) -> tuple[Any, Any]:
    """A layer's logical [B, 2, N, H * hs] view as its K [B, H, hs/x, N, x] and V [B, H, N/x, hs, x] tiles
    (views): each (side, block) page must be dense, as the shuffle kernels address it. The pages may lie
    as planes of whole blocks (LHBNC) or alternate K and V block by block (LBHNC); the binding's memory
    check then proves, element by element, that no two pages meet."""
    if view.dim() != 4 or view.shape[1] != 2 or view.shape[3] != heads * size or view.shape[2] % x or size % x or \
            view.stride(3) != 1 or view.stride(2) != heads * size:
        raise KVLayoutError(f"from_vllm: a SHUFFLE layer view {list(view.shape)} strides {list(view.stride())} is "
                            f"not [blocks, 2, block_size, {heads} * {size}] with dense pages of whole {x}-tiles")
    blocks, slots = view.shape[0], view.shape[2]
    page = slots * heads * size
    if min(view.stride(0), view.stride(1)) < page:
        raise KVLayoutError(f"from_vllm: a SHUFFLE layer view strides {list(view.stride())} overlap its pages of "
                            f"{page} values: each (side, block) page must be whole, as LHBNC and LBHNC lay them")
    k, v = (view[:, i].as_strided((blocks, page), (view.stride(0), 1)) for i in (0, 1))
    return (k.view(blocks, heads, size // x, slots, x), v.view(blocks, heads, slots // x, size, x))


def _shuffle_group(index: int, names: tuple[str, ...], views: list[Any], spec: Any, rest: tuple[Any, Any, Any]
                   ) -> VllmGroup:
    """One group of ROCm AITER SHUFFLE layers bound to the vectorized_5d spec of its dtype."""
    version, pairing, connector_args = rest
    heads, size, x, layout = _shuffle_spec(spec, index)
    package = _package(pairing.package)
    span = dict(package.LAYOUTS[layout].get("versions", ())).get("vllm")
    release = release_of({"engine": "vllm", "engine_version": version})
    if span is None or (release is not None and not version_in(release, span)):
        raise KVLayoutError(f"from_vllm: {layout} describes vLLM {span or 'no'} SHUFFLE caches, not {release}")
    sides = [_shuffle_sides(v, heads, size, x) for v in views]
    kvcaches = [[k for k, _ in sides], [v for _, v in sides]]  # (K layers, V layers), as SGLang's pool
    extents = {"L": len(views), "B": int(views[0].shape[0]), "N": int(views[0].shape[2]), "H": heads, "C": size}
    found = Detection(layout, None, extents, tuple(range(5)), ("kv_layout",))
    connector = package.get(layout, pairing.kv_object or "kv_planes")(**connector_args)
    connector.bind(kvcaches)
    return VllmGroup(index, names, kvcaches, found, connector)
