"""The fact table of the planes kind: the built-in format-2 specs (caches of several parts or
fields, and the packed objects that hold their planes), written from the sources, and the
comparison of a format-2 spec with it (`parts_disagreement`, which kvgen.oracle.facts.layouts calls).
It merges facts.quant's table (the quantized caches, one source of the same kind) into PARTS_FACTS;
the vocabulary of both is in kvgen.oracle.facts.table.

Like kvgen.oracle.facts.layouts, this table does not read specs. For each cache it says the containers
the engine hands over (the tuple of parts included), each part's tensor shape and dtype, and for
every value of every plane (a part, or a field of a part) where its first byte lies: a container
path, the index of the storage element holding it, and the byte inside that element. For the
packed objects it says where the same value lies in the object, given the planes of the cache.

Sources (projects as named on GitHub):

- vLLM (vllm-project/vllm): vllm/attention/layer.py (Attention.__init__: `self._k_scale =
  torch.tensor(1.0, dtype=torch.float32)`, `_v_scale` likewise: 0-dim per-layer scales),
  vllm/v1/attention/backends/flash_attn.py (get_kv_cache_shape (2, num_blocks, block_size,
  num_kv_heads, head_size)), vllm/v1/attention/backends/mla/flashmla_sparse.py (the fp8_ds_mla
  cache: (num_blocks, block_size, 656) uint8).
- DeepSeek FlashMLA (deepseek-ai/FlashMLA) README, "FP8 KV cache": each token's 656 bytes are 512
  float8_e4m3 NoPE values, then 4 float32 scales (one per 128 values), then 64 bfloat16 RoPE values.
- vLLM-Gaudi (vllm-project/vllm-gaudi): vllm_gaudi/attention/ops/hpu_paged_attn.py
  (get_kv_cache_shape returns (num_blocks * block_size, num_kv_heads, head_size); split_kv_cache
  reads kv_cache[0..3] as key_cache, value_cache, k_scale, v_scale), vllm_gaudi/v1/worker/
  hpu_model_runner.py before commit 472ed884 (kv_scales_shape = kv_cache_shape[:-1] + (1,),
  bfloat16; `kv_caches[layer_name] = (key_cache, value_cache, key_scales, value_scales)`).
- SGLang (sgl-project/sglang): python/sglang/srt/mem_cache/memory_pool.py MHATokenToKVPool
  (k_buffer [size + page_size, head_num, head_dim], v_buffer [..., head_num, v_head_dim]; under
  kv_cache_layout "vectorized_5d" the 5-D tiles of _create_buffers_normal), python/sglang/kernels/ops/
  kvcache/shuffle_5d_cache.py (reshape_and_cache_shuffle_5d: where the tiles keep each value).
- LMCache 0.5.6 (LMCache/LMCache): kv_format/specs/nl_x_np_x_nb_bs_one_hs.py ("NL x NP x [NB, BS,
  1, HS]": a tuple of NP planes [num_blocks, block_size, 1, width], 2 for MLA (latent, rope), 3
  for DSA (latent, rope, dsa); "The transferred object is one flat plane of the summed width";
  hidden_dim counts "Columns ... in dtype elements" of the first plane), kv_format/specs/
  nl_x_nb_bsv_bss.py ("NL x [NB, BS, 132] uint8": "per block, all tokens' 128-byte fp8 values
  first, then all tokens' 4-byte fp32 scales"), kv_format/detectors/vllm.py (a 3-D uint8 plane of
  last dim 132 is the indexer cache, any other 3-D plane NL_X_NB_BS_HS), platform/torch_ops/
  mp_mem_kernels.py _transfer_per_layer_mla_tuple (an object row holds the planes in order, each
  at the byte offset after the one before), LMCache's blocked-scale transfer test ("LMCache's
  chunk rows are canonical token-major [vals | scale] (132 B)"), memory_management.py (KV_MLA_FMT
  = 6, "[1, num_layers, num_tokens, aligned_head_size]").
- kvgen's own regions objects (KVGEN_PLANES, KVGEN_PLANES_LAYER): docs/spec-language.md, "Packed
  objects": per layer, each plane as a dense [KV T H C] region (the axes it lacks left out), in
  plane order, each starting at a multiple of 16 bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvgen.oracle.address import ObjectAddresses, plane_address, plane_count
from kvgen.oracle.agreement import first_difference
from kvgen.oracle.facts.quant import QUANT_PARTS_FACTS
from kvgen.oracle.facts.table import (
    BYTES,
    ByteAddress,
    EngineGeometry,
    Level,
    PartFact,
    PartsFact,
    PlaneAddress,
    PlaneFact,
    width,
)
from kvgen.oracle.reference.planes import part_shape
from kvgen.spec.library import load_library
from kvgen.spec.model import Spec

PARTS_FACTS: dict[str, PartsFact] = {}

PER_LAYER_TUPLE: tuple[Level, ...] = (("list", "L"), ("tuple", "P"))


def _register(fact: PartsFact) -> None:
    PARTS_FACTS[fact.name] = fact


def _elements(shape: Sequence[int], index: Sequence[int]) -> int:
    flat = 0
    for i, n in zip(index, shape, strict=True):
        flat = flat * n + i
    return flat


# -- vLLM fp8 MLA (fp8_ds_mla): 656-byte rows ------------------------------------------------------
# flashmla_sparse.py: (num_blocks, block_size, 656) uint8; FlashMLA: bytes [0, 512) fp8 NoPE,
# [512, 528) 4 float32 scales, [528, 656) 64 bfloat16 RoPE values. LMCache: NL_X_NB_BS_HS.
def _fp8_mla(start: int, size: int) -> PlaneAddress:
    return lambda g, layer, kv, slot, h, c: ((layer,), (slot // g.N, slot % g.N, start + c * size), 0)


_register(PartsFact(
    "vllm_mla_fp8", (("list", "L"),), (PartFact("", lambda g: (g.B, g.N, 656), ("uint8",)),),
    (PlaneFact("nope", 0, "float8_e4m3fn", lambda g: 512, False, False, True, _fp8_mla(0, 1)),
     PlaneFact("scale", 0, "float32", lambda g: 4, False, False, True, _fp8_mla(512, 4)),
     PlaneFact("rope", 0, "bfloat16", lambda g: 64, False, False, True, _fp8_mla(528, 2))),
    lmcache="NL_X_NB_BS_HS"))


# -- DeepSeek-V3.2 indexer keys: [BS x 128 fp8][BS x fp32 scale] per block ---------------------------
# nl_x_nb_bsv_bss.py: tensor [NB, BS, 132] uint8; block b's 132 * BS bytes hold token n's values at
# n * 128 and its scale at BS * 128 + n * 4.
def _indexer(region: Callable[[EngineGeometry], int], per_token: int) -> PlaneAddress:
    def where(g: EngineGeometry, layer: int, kv: int, slot: int, h: int, c: int) -> ByteAddress:
        byte = region(g) + (slot % g.N) * per_token + c
        return (layer,), (slot // g.N, byte // 132, byte % 132), 0
    return where


_register(PartsFact(
    "vllm_dsa_indexer", (("list", "L"),), (PartFact("", lambda g: (g.B, g.N, 132), ("uint8",)),),
    (PlaneFact("values", 0, "float8_e4m3fn", lambda g: 128, False, False, True, _indexer(lambda g: 0, 128)),
     PlaneFact("scale", 0, "float32", lambda g: 1, False, False, True, _indexer(lambda g: 128 * g.N, 4))),
    lmcache="NL_X_NB_BSV_BSS"))


# -- vLLM-Ascend MLA / DSA plane tuples -------------------------------------------------------------
# nl_x_np_x_nb_bs_one_hs.py: per layer a tuple of [num_blocks, block_size, 1, width_p] planes,
# (latent, rope) or (latent, rope, dsa); widths differ, dtypes may differ.
def _ascend(part: int) -> PlaneAddress:
    return lambda g, layer, kv, slot, h, c: ((layer, part), (slot // g.N, slot % g.N, 0, c), 0)


def _ascend_fact(name: str, planes: Sequence[str]) -> PartsFact:
    parts = tuple(PartFact(p, lambda g, i=i: (g.B, g.N, 1, width(g, i)), ()) for i, p in enumerate(planes))
    return PartsFact(name, PER_LAYER_TUPLE, parts,
                     tuple(PlaneFact(p, i, None, lambda g, i=i: width(g, i), False, False, True, _ascend(i))
                           for i, p in enumerate(planes)),
                     lmcache="NL_X_NP_X_NB_BS_ONE_HS")


_register(_ascend_fact("vllm_ascend_mla", ("latent", "rope")))
_register(_ascend_fact("vllm_ascend_dsa", ("latent", "rope", "indexer")))


# -- vLLM-Gaudi: (key_cache, value_cache, k_scale, v_scale) per layer --------------------------------
# key/value [num_blocks * block_size, num_kv_heads, head_size] fp8; scales [..., num_kv_heads, 1] bf16.
def _gaudi(part: int) -> PlaneAddress:
    return lambda g, layer, kv, slot, h, c: ((layer, part), (slot, h, c), 0)


_register(PartsFact(
    "vllm_gaudi_fp8", PER_LAYER_TUPLE,
    (PartFact("k", lambda g: (g.B * g.N, g.H, width(g, 0)), ("float8_e4m3fn",)),
     PartFact("v", lambda g: (g.B * g.N, g.H, width(g, 1)), ("float8_e4m3fn",)),
     PartFact("k_scale", lambda g: (g.B * g.N, g.H, 1), ("bfloat16",)),
     PartFact("v_scale", lambda g: (g.B * g.N, g.H, 1), ("bfloat16",))),
    (PlaneFact("k", 0, "float8_e4m3fn", lambda g: width(g, 0), False, True, True, _gaudi(0)),
     PlaneFact("v", 1, "float8_e4m3fn", lambda g: width(g, 1), False, True, True, _gaudi(1)),
     PlaneFact("k_scale", 2, "bfloat16", lambda g: 1, False, True, True, _gaudi(2)),
     PlaneFact("v_scale", 3, "bfloat16", lambda g: 1, False, True, True, _gaudi(3)))))


# -- vLLM fp8 FlashAttention cache with the layer's per-tensor scales --------------------------------
# flash_attn.py: (2, num_blocks, block_size, num_kv_heads, head_size); layer.py: 0-dim float32
# _k_scale and _v_scale, one each per layer, no slot: they hold for every token.
_register(PartsFact(
    "vllm_fp8_tensor_scales", PER_LAYER_TUPLE,
    (PartFact("kv", lambda g: (2, g.B, g.N, g.H, width(g, 0)), ("float8_e4m3fn", "float8_e5m2")),
     PartFact("k_scale", lambda g: (), ("float32",)), PartFact("v_scale", lambda g: (), ("float32",))),
    (PlaneFact("kv", 0, None, lambda g: width(g, 0), True, True, True,
               lambda g, layer, kv, slot, h, c: ((layer, 0), (kv, slot // g.N, slot % g.N, h, c), 0)),
     PlaneFact("k_scale", 1, "float32", lambda g: 1, False, False, False,
               lambda g, layer, kv, slot, h, c: ((layer, 1), (), 0)),
     PlaneFact("v_scale", 2, "float32", lambda g: 1, False, False, False,
               lambda g, layer, kv, slot, h, c: ((layer, 2), (), 0))),
    fixed={"KV": 2}))


# -- SGLang MHA with a V head size of its own: (k_buffer, v_buffer), each a list over layers ---------
_register(PartsFact(
    "sglang_mha_v_head", (("seq", "P"), ("list", "L")),
    (PartFact("k", lambda g: (g.B * g.N, g.H, width(g, 0)), ()),
     PartFact("v", lambda g: (g.B * g.N, g.H, width(g, 1)), ())),
    (PlaneFact("k", 0, None, lambda g: width(g, 0), False, True, True,
               lambda g, layer, kv, slot, h, c: ((0, layer), (slot, h, c), 0)),
     PlaneFact("v", 1, None, lambda g: width(g, 1), False, True, True,
               lambda g, layer, kv, slot, h, c: ((1, layer), (slot, h, c), 0)))))


# -- SGLang MHA, kv_cache_layout vectorized_5d (ROCm AITER's SHUFFLE layout) -------------------------
# memory_pool.py MHATokenToKVPool._create_buffers_normal: per layer K (num_blocks, head_num,
# head_dim // X, page_size, X) and V (num_blocks, head_num, page_size // X, v_head_dim, X), X = 16 //
# store_dtype.itemsize (fp8 kv_cache_dtypes are stored as uint8: X = 16); (k_buffer, v_buffer) lists.
# sglang/kernels/ops/kvcache/shuffle_5d_cache.py reshape_and_cache_shuffle_5d: value d of slot s (head
# h) at K [s // page, h, d // X, s % page, d % X], V [s // page, h, (s % page) // X, d, s % page % X].
def _shuffle_k(x: int) -> PlaneAddress:
    return lambda g, layer, kv, slot, h, c: ((0, layer), (slot // g.N, h, c // x, slot % g.N, c % x), 0)


def _shuffle_v(x: int) -> PlaneAddress:
    return lambda g, layer, kv, slot, h, c: ((1, layer), (slot // g.N, h, slot % g.N // x, c, slot % g.N % x), 0)


def _vectorized_5d(name: str, x: int, dtypes: tuple[str, ...]) -> PartsFact:
    value = dtypes[0] if len(dtypes) == 1 else None  # a value is the part's element, whichever dtype it has
    return PartsFact(
        name, (("seq", "P"), ("list", "L")),
        (PartFact("k", lambda g: (g.B, g.H, width(g, 0) // x, g.N, x), dtypes),
         PartFact("v", lambda g: (g.B, g.H, g.N // x, width(g, 1), x), dtypes)),
        (PlaneFact("k", 0, value, lambda g: width(g, 0), False, True, True, _shuffle_k(x)),
         PlaneFact("v", 1, value, lambda g: width(g, 1), False, True, True, _shuffle_v(x))),
        tiles={"N": x, "C": x})


_register(_vectorized_5d("sglang_mha_vectorized_5d", 8, ("bfloat16", "float16")))
_register(_vectorized_5d("sglang_mha_vectorized_5d_fp8", 16, ("uint8",)))


# -- SGLang HiCache MHA host pool, layout page_unified in head groups -------------------------------
# pool_host/page_unified.py PageUnifiedLayout.page_dims: one kv_buffer (page_num, head_group_num,
# layer_num, 2, page_size, head_num // head_group_num, head_dim); head h lies in group h // (H / G) at
# place h % (H / G). Compared at two heads per group (the spec reads that factor from the tensor), H
# counted in groups: H = 4 is two groups of two heads.
_register(PartsFact(
    "hicache_page_unified_grouped", (),
    (PartFact("", lambda g: (g.B, g.H // 2, g.L, 2, g.N, 2, g.C), ()),),
    (PlaneFact("cache", 0, None, lambda g: g.C, True, True, True,
               lambda g, layer, kv, slot, h, c: ((), (slot // g.N, h // 2, layer, kv, slot % g.N, h % 2, c), 0)),),
    fixed={"KV": 2}, tiles={"H": 2}, splits={"H%g": 2}))


# -- packed objects ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PackedFact:
    """An object holding a cache's planes: its format, code, containers and where a value
    lies given the cache's planes (their value bytes and counts)."""

    name: str
    lmcache: str
    code: int
    layerwise: bool
    shape: Callable[[EngineGeometry, PartsFact], tuple[int, ...]]
    #: address(g, cache, plane, l, kv, t, h, c): the element's coordinates follow the plane.
    address: Callable[..., ByteAddress]
    #: Whether the object can hold this cache's planes.
    fits: Callable[[PartsFact], bool]


PACKED_FACTS: dict[str, PackedFact] = {}


def _row_bytes(cache: PartsFact, g: EngineGeometry, upto: int | None = None) -> int:
    planes = cache.planes if upto is None else cache.planes[:upto]
    return sum(p.count(g) * cache.value_bytes(p) for p in planes)


def _row_fits(cache: PartsFact) -> bool:
    return all(p.slots and not p.kv and not p.heads for p in cache.planes)


def _rows(layerwise: bool) -> PackedFact:
    # One flat plane of the summed width, in elements of the first part's dtype; each token's row
    # holds plane 0's bytes, then plane 1's, ... (mp_mem_kernels byte_off += nbytes per plane).
    def shape(g: EngineGeometry, cache: PartsFact) -> tuple[int, ...]:
        w = _row_bytes(cache, g) // cache.parts[0].item()
        return (g.T, w) if layerwise else (1, g.L, g.T, w)

    def where(g: EngineGeometry, cache: PartsFact, plane: PlaneFact, *element: int) -> ByteAddress:
        layer, _, t, _, c = element
        item = cache.parts[0].item()
        byte = _row_bytes(cache, g, cache.planes.index(plane)) + c * cache.value_bytes(plane)
        return ((layer,), (t, byte // item), byte % item) if layerwise else ((), (0, layer, t, byte // item),
                                                                              byte % item)
    return PackedFact("kv_mla_rows_layer" if layerwise else "kv_mla_rows", "KV_MLA_FMT", 6, layerwise, shape, where,
                      _row_fits)


PACKED_FACTS["kv_mla_rows"] = _rows(False)
PACKED_FACTS["kv_mla_rows_layer"] = _rows(True)


def _region_extents(g: EngineGeometry, cache: PartsFact, plane: PlaneFact) -> tuple[int, ...]:
    """A plane's region per layer: [KV, T, H, C] with the axes it lacks left out."""
    return tuple(n for n, here in ((2, plane.kv), (g.T, plane.slots), (g.H, plane.heads),
                                   (plane.count(g), True)) if here)


def _regions(g: EngineGeometry, cache: PartsFact) -> tuple[list[int], int]:
    starts, at = [], 0
    for plane in cache.planes:
        starts.append(at)
        size = cache.value_bytes(plane)
        for n in _region_extents(g, cache, plane):
            size *= n
        at += (size + 15) // 16 * 16
    return starts, at


def _planes(layerwise: bool) -> PackedFact:
    def shape(g: EngineGeometry, cache: PartsFact) -> tuple[int, ...]:
        layer = _regions(g, cache)[1]
        return (layer,) if layerwise else (g.L, layer)

    # A fact is asked for every element of a cache in turn: each plane's region is worked out
    # once per (geometry, cache, plane), kept with the objects it was made for (ids alone could
    # be reused by later objects).
    regions: dict[tuple[Any, ...], tuple[PartsFact, PlaneFact, int, tuple[int, ...], int]] = {}

    def region(g: EngineGeometry, cache: PartsFact, plane: PlaneFact) -> tuple[int, tuple[int, ...], int]:
        key = (g, id(cache), id(plane))
        kept = regions.get(key)
        if kept is None or kept[0] is not cache or kept[1] is not plane:
            start = _regions(g, cache)[0][cache.planes.index(plane)]
            kept = regions[key] = (cache, plane, start, _region_extents(g, cache, plane), cache.value_bytes(plane))
        return kept[2:]

    def where(g: EngineGeometry, cache: PartsFact, plane: PlaneFact, *element: int) -> ByteAddress:
        layer, kv, t, h, c = element
        index = [i for i, here in ((kv, plane.kv), (t, plane.slots), (h, plane.heads), (c, True)) if here]
        start, extents, size = region(g, cache, plane)
        byte = start + _elements(extents, index) * size
        return ((layer,), (byte,), 0) if layerwise else ((), (layer, byte), 0)

    name = "kv_planes_layer" if layerwise else "kv_planes"
    return PackedFact(name, "KVGEN_PLANES_LAYER" if layerwise else "KVGEN_PLANES", 129 if layerwise else 128,
                      layerwise, shape, where, lambda cache: True)


PACKED_FACTS["kv_planes"] = _planes(False)
PACKED_FACTS["kv_planes_layer"] = _planes(True)


# -- using the table ---------------------------------------------------------------------------------

def value_sizes(plane: PlaneFact, g: EngineGeometry) -> tuple[int, int, int, int, int]:
    """How many layer, kv, slot, h and c one plane has (one slot for a plane without slots)."""
    return g.L, 2 if plane.kv else 1, g.B * g.N if plane.slots else 1, g.H if plane.heads else 1, plane.count(g)


def values(fact: PartsFact, plane: PlaneFact, g: EngineGeometry) -> Iterator[tuple[int, int, int, int, int]]:
    """Every (layer, kv, slot, h, c) of one plane."""
    return itertools.product(*(range(n) for n in value_sizes(plane, g)))


def _coords(pos: str, e: tuple[Any, ...]) -> dict[str, Any]:
    return dict(zip(("l", "kv", pos, "h", "c"), e, strict=True))


def extents(fact: PartsFact, g: EngineGeometry) -> dict[str, int]:
    """The geometry as kvgen extents, with each part's free width."""
    out = {"L": g.L, "KV": 2, "B": g.B, "N": g.N, "H": g.H, "C": g.C, "T": g.T}
    out.update({f"C.{p.name}": width(g, i) for i, p in enumerate(fact.parts)})
    return {**out, **fact.splits}


def _part_disagreement(spec: Spec, part: Any, pf: PartFact, ext: Mapping[str, int], g: EngineGeometry) -> str | None:
    """Where one part of a spec differs from its facts (shape, dtypes), or None."""
    if part_shape(spec, part, ext) != pf.shape(g):
        return f"part {part.name}: shape {part_shape(spec, part, ext)} at {g}, the source says {pf.shape(g)}"
    if pf.dtypes and part.dtypes != pf.dtypes:
        return f"part {part.name}: dtypes {list(part.dtypes)}, the source stores {list(pf.dtypes)}"
    return None


def _plane_disagreement(spec: Spec, plane: Any, pf: PlaneFact, fact: PartsFact, g: EngineGeometry) -> str | None:
    """Where one moved plane of a spec differs from its facts (values, axes, every address), or None."""
    ext = extents(fact, g)
    if plane.dtype != pf.dtype or plane_count(spec, plane, ext) != pf.count(g):
        return (f"plane {plane.name}: {plane_count(spec, plane, ext)} x {plane.dtype}, the source has "
                f"{pf.count(g)} x {pf.dtype}")
    if (plane.has_slots, "KV" in plane.axes, "H" in plane.axes) != (pf.slots, pf.kv, pf.heads):
        return f"plane {plane.name}: axes {plane.axes} (slots: {plane.has_slots}), the source differs"
    item = fact.parts[pf.part].item()
    found = first_difference(value_sizes(pf, g), functools.partial(pf.address, g),
                             lambda *e: plane_address(spec, plane, _coords("slot", e), ext, item))
    if found is None:
        return None
    (layer, kv, slot, h, c), want, got = found
    return (f"plane {plane.name} (l={layer}, kv={kv}, slot={slot}, h={h}, c={c}) at {got}, the source "
            f"says {want} ({g})")


def _named(what: str, got: Sequence[Any], source: Sequence[Any]) -> str | None:
    names, expected = [x.name for x in got], [x.name for x in source]
    return f"{what} {names}, the source has {expected}" if names != expected else None


def _parts_comparisons(spec: Spec, fact: PartsFact, g: EngineGeometry) -> Iterator[str | None]:
    """Each comparison in turn (None where it agrees); a later one runs only once every earlier one agreed."""
    if spec.lmcache_format != fact.lmcache:
        yield f"LMCache format {spec.lmcache_format}, the source says {fact.lmcache}"
    if dict(spec.sizes) != dict(fact.fixed):
        yield f"sizes {dict(spec.sizes)}, the source fixes {dict(fact.fixed)}"
    levels = tuple(axis for _, axis in fact.container)
    if spec.lists != levels:
        yield f"lists {list(spec.lists)}, the source hands over {list(levels)}"
    yield _named("parts", spec.parts, fact.parts)
    ext = extents(fact, g)
    for part, pf in zip(spec.parts, fact.parts, strict=True):
        yield _part_disagreement(spec, part, pf, ext, g)
    planes = spec.moved_planes()
    yield _named("planes", planes, fact.planes)
    for plane, pf in zip(planes, fact.planes, strict=True):
        yield _plane_disagreement(spec, plane, pf, fact, g)


def parts_disagreement(spec: Spec, g: EngineGeometry) -> str | None:
    """The first way a format-2 spec differs from the facts, or None. A packed object is
    compared through every built-in cache whose planes it holds."""
    if not spec.is_paged:
        return _packed_disagreement(spec, g)
    fact = PARTS_FACTS.get(spec.name)
    if fact is None:
        return f"no fact entry for {spec.name}"
    return next((why for why in _parts_comparisons(spec, fact, source_geometry(fact, g)) if why), None)


def source_geometry(fact: PartsFact, g: EngineGeometry) -> EngineGeometry:
    """`g` with the extents the source fixes (one head slot, say): the source has no other; and the
    extents it takes in whole tiles counted in tiles (N = 4 with tiles of 8 is a page of 32 slots),
    which keeps the geometry's extents apart from one another."""
    axes = {"L", "B", "N", "H", "C", "T"}
    g = dataclasses.replace(g, **{k: getattr(g, k) * f for k, f in fact.tiles.items() if k in axes})
    return dataclasses.replace(g, **{k: v for k, v in fact.fixed.items() if k in axes})


@functools.cache
def _builtin_caches() -> tuple[Spec, ...]:
    return tuple(s for s in load_library().paged if s.name in PARTS_FACTS)


def _packed_disagreement(spec: Spec, g: EngineGeometry) -> str | None:
    fact = PACKED_FACTS.get(spec.name)
    if fact is None:
        return f"no fact entry for {spec.name}"
    if (spec.format, spec.code) != (fact.lmcache, fact.code):
        return f"format {spec.format} ({spec.code}), the source says {fact.lmcache} ({fact.code})"
    if bool(spec.lists) != fact.layerwise:
        return f"lists {list(spec.lists)}, the source has {'one object per layer' if fact.layerwise else 'one'}"
    for cache in _builtin_caches():
        cf = PARTS_FACTS[cache.name]
        if not fact.fits(cf):
            continue
        ext = extents(cf, g)
        sizes = {p.name: cf.value_bytes(pf) for p, pf in zip(cache.moved_planes(), cf.planes, strict=True)}
        item = BYTES["uint8"] if spec.pack == "regions" else cf.parts[0].item()
        try:
            at = ObjectAddresses(cache, spec, ext, sizes, item)
        except (KeyError, ValueError) as exc:
            return f"holding {cache.name}: {type(exc).__name__} {exc}"
        for plane, pf in zip(cache.moved_planes(), cf.planes, strict=True):
            found = first_difference(value_sizes(pf, dataclasses.replace(g, B=1, N=g.T)),
                                     functools.partial(fact.address, g, cf, pf),
                                     lambda *e, at=at, plane=plane: at.address(plane, _coords("t", e)))
            if found is not None:
                (layer, kv, t, h, c), want, got = found
                return (f"holding {cache.name}: plane {plane.name} (l={layer}, kv={kv}, t={t}, h={h}, c={c}) "
                        f"at {got}, the source says {want} ({g})")
    return None


# vLLM's and SGLang's quantized caches (oracle/facts/quant), merged with this module's own.
for _quant in QUANT_PARTS_FACTS.values():
    _register(_quant)
