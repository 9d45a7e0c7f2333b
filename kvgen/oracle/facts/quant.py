"""Facts about vLLM 0.33's quantized caches (kv_quant_mode), written from its sources without
reading specs; merged into kvgen.oracle.facts.planes.PARTS_FACTS (which imports this module),
so tests/test_facts*.py and `kvgen verify` compare the built-in specs with them.

Sources (vllm-project/vllm 0.33.0):
* vllm/v1/kv_cache_interface.py: AttentionSpec.num_heads (num_head_slots, else num_kv_heads),
  state_content_size_bytes (state_content_bytes, else K and V content), the logical per-layer
  view [B, H, N, C]; KVCacheLayout LBNHC stores it as [B, N, H, C], LBHNC as it is.
* vllm/v1/attention/backends/triton_attn.py: customize_spec, for the per-token-head modes
  C = (hs_k + hs_v) * dtype size + 2 * 4 (INT4: each head size halved, two values per byte);
  _ensure_scale_caches: per (head, slot) [K (hs) | K scale fp32 | V (hs) | V scale fp32].
* vllm/v1/attention/ops/int4_per_token_head.py: pack_int4_nibbles (value 2j low).
* vllm/v1/attention/backends/flashinfer.py: customize_spec for NVFP4, num_head_slots 2 * H and C =
  nvfp4_kv_cache_full_dim(hs) = hs // 2 + hs // 16; _nvfp4_kv_views: a page is [K side | V side],
  each H * N * C bytes; vllm/utils/torch_utils.py nvfp4_split_data_scale: a side is every
  (head, slot) cell's hs // 2 data bytes, then every cell's hs // 16 fp8 scales (one per 16 values).
  Under NHD strides (LBNHC: the page stored [N, 2H, C]) the sides are still the page's halves, each
  every (slot, head) cell's data, slot-major, then every cell's scales.

The built-in specs are for head size 128, as stated here.
"""

from __future__ import annotations

from kvgen.oracle.facts.table import EngineGeometry as Geometry
from kvgen.oracle.facts.table import PartFact, PartsFact, PlaneFact, width
from kvgen.spec.model import Spec

#: This module's entries, merged into kvgen.oracle.facts.planes.PARTS_FACTS there.
QUANT_PARTS_FACTS: dict[str, PartsFact] = {}


def _register(fact: PartsFact) -> None:
    QUANT_PARTS_FACTS[fact.name] = fact


#: The head size of the built-in quantized specs.
HEAD = 128
#: One (head, slot, side) of a Triton per-token-head cache: data bytes, then a 4-byte fp32 scale.
SCALE = 4


def _triton(name: str, storage: str, values: str, data_bytes: int) -> PartsFact:
    half = data_bytes + SCALE  # each of K's and V's share of C

    def at(start: int, size: int):  # noqa: ANN202 (a PlaneAddress)
        return lambda g, layer, kv, slot, h, c: ((layer,), (slot // g.N, slot % g.N, h, kv * half + start + c * size),
                                                 0)

    return PartsFact(
        name, (("list", "L"),), (PartFact("", lambda g: (g.B, g.N, g.H, 2 * half), (storage,)),),
        (PlaneFact("values", 0, values, lambda g: data_bytes, True, True, True, at(0, 1)),
         PlaneFact("scale", 0, "float32", lambda g: 1, True, True, True, at(data_bytes, SCALE))),
        fixed={"KV": 2})


_register(_triton("vllm_int8_per_token_head", "int8", "int8", HEAD))
_register(_triton("vllm_fp8_per_token_head", "uint8", "float8_e4m3fn", HEAD))
# Two int4 values per byte: the plane moves HEAD // 2 packed bytes.
_register(_triton("vllm_int4_per_token_head", "uint8", "int4", HEAD // 2))

NVFP4_DATA, NVFP4_SCALES = HEAD // 2, HEAD // 16
NVFP4_CELL = NVFP4_DATA + NVFP4_SCALES


def _nvfp4(start: int, size: int):  # noqa: ANN202 (a PlaneAddress)
    """Byte c of a cell's region (data at 0, scales after every cell's data) in side kv of a page."""
    def where(g: Geometry, layer: int, kv: int, slot: int, h: int, c: int):  # noqa: ANN202
        cells = g.H * g.N
        byte = kv * cells * NVFP4_CELL + start * cells + (h * g.N + slot % g.N) * size + c
        row, col = byte // NVFP4_CELL, byte % NVFP4_CELL  # not divmod: index grids take // and %
        return (layer,), (slot // g.N, row // g.N, row % g.N, col), 0
    return where


_register(PartsFact(
    "vllm_nvfp4", (("list", "L"),), (PartFact("", lambda g: (g.B, 2 * g.H, g.N, NVFP4_CELL), ("uint8",)),),
    (PlaneFact("values", 0, "fp4_e2m1", lambda g: NVFP4_DATA, True, True, True, _nvfp4(0, NVFP4_DATA)),
     PlaneFact("scale", 0, "float8_e4m3fn", lambda g: NVFP4_SCALES, True, True, True,
               _nvfp4(NVFP4_DATA, NVFP4_SCALES))),
    fixed={"KV": 2}))



def _nvfp4_nhd(start: int, size: int):  # noqa: ANN202 (a PlaneAddress)
    """Under NHD (LBNHC) a page is stored [N, 2H, cell]; _nvfp4_kv_views takes its first half as the K
    side and the second as V, each every (slot, head) cell's data, slot-major, then every cell's scales."""
    def where(g: Geometry, layer: int, kv: int, slot: int, h: int, c: int):  # noqa: ANN202
        cells = g.H * g.N
        byte = kv * cells * NVFP4_CELL + start * cells + (slot % g.N * g.H + h) * size + c
        row, col = byte // NVFP4_CELL, byte % NVFP4_CELL  # not divmod: index grids take // and %
        return (layer,), (slot // g.N, row // (2 * g.H), row % (2 * g.H), col), 0
    return where


_register(PartsFact(
    "vllm_nvfp4_nhd", (("list", "L"),), (PartFact("", lambda g: (g.B, g.N, 2 * g.H, NVFP4_CELL), ("uint8",)),),
    (PlaneFact("values", 0, "fp4_e2m1", lambda g: NVFP4_DATA, True, True, True, _nvfp4_nhd(0, NVFP4_DATA)),
     PlaneFact("scale", 0, "float8_e4m3fn", lambda g: NVFP4_SCALES, True, True, True,
               _nvfp4_nhd(NVFP4_DATA, NVFP4_SCALES))),
    fixed={"KV": 2}))

# -- SGLang 0.5.23 quantized pools (sglang/srt/mem_cache/memory_pool.py) ----------------------------
# MHATokenToKVPoolFP4: (k_buffer, v_buffer, k_scale_buffer, v_scale_buffer), each a list over layers;
# K and V [rows, heads, head_dim // 2] uint8, scales [rows, heads * head_dim // 16] uint8.
# MLATokenToKVPoolFP4: (kv_buffer, kv_scale_buffer); [rows, 1, kv_cache_dim // 2], [rows, kv_cache_dim // 16].
PAIR_OF_LISTS = (("seq", "P"), ("list", "L"))
MLA_DIM = 576


def _pool(part: int, heads: bool, flat: int):  # noqa: ANN202 (a PlaneAddress)
    """Value c of a row: [rows, heads, C], or without heads [rows, 1, C] (flat 0) or [rows, C]."""
    def where(g: Geometry, layer: int, kv: int, slot: int, h: int, c: int):  # noqa: ANN202
        if heads:
            return (part, layer), (slot, h, c), 0
        return (part, layer), ((slot, 0, c) if flat == 0 else (slot, c)), 0
    return where


_register(PartsFact(
    "sglang_mha_fp4", PAIR_OF_LISTS,
    (PartFact("k", lambda g: (g.B * g.N, g.H, HEAD // 2), ("uint8",)),
     PartFact("v", lambda g: (g.B * g.N, g.H, HEAD // 2), ("uint8",)),
     # Scale rows are heads * head_dim // 16 bytes, a width the spec reads from the tensor: here, as
     # for every free width in these tables, the part's test width (tests/test_engine_sglang_quant.py
     # binds SGLang's own pool, whose rows are 8 per head).
     PartFact("k_scale", lambda g: (g.B * g.N, width(g, 2)), ("uint8",)),
     PartFact("v_scale", lambda g: (g.B * g.N, width(g, 3)), ("uint8",))),
    (PlaneFact("k.values", 0, "fp4_e2m1", lambda g: HEAD // 2, False, True, True, _pool(0, True, 0)),
     PlaneFact("v.values", 1, "fp4_e2m1", lambda g: HEAD // 2, False, True, True, _pool(1, True, 0)),
     # A token's scales of every head are one row.
     PlaneFact("k_scale", 2, "uint8", lambda g: width(g, 2), False, False, True, _pool(2, False, 1)),
     PlaneFact("v_scale", 3, "uint8", lambda g: width(g, 3), False, False, True, _pool(3, False, 1)))))

_register(PartsFact(
    "sglang_mla_fp4", PAIR_OF_LISTS,
    (PartFact("kv", lambda g: (g.B * g.N, 1, MLA_DIM // 2), ("uint8",)),
     PartFact("scale", lambda g: (g.B * g.N, MLA_DIM // 16), ("uint8",))),
    (PlaneFact("kv.values", 0, "fp4_e2m1", lambda g: MLA_DIM // 2, False, False, True, _pool(0, False, 0)),
     PlaneFact("scale", 1, "uint8", lambda g: MLA_DIM // 16, False, False, True, _pool(1, False, 1)))))


# MHATokenToKVPoolMXFP8 with a page size other than 128 (page 128 interleaves its scales in FA4 atoms):
# (k_buffer, v_buffer, k_scale_buffer, v_scale_buffer), each a list over layers; K and V
# [rows, heads, head_dim] float8_e4m3fn, scales [rows, heads, head_dim // 32] float8_e8m0fnu
# (MXFP8_SCALE_BLOCK_SIZE 32), indexed by slot (_write_scales, _read_scales).
MXFP8_BLOCK = 32
_register(PartsFact(
    "sglang_mha_mxfp8", PAIR_OF_LISTS,
    (PartFact("k", lambda g: (g.B * g.N, g.H, HEAD), ("float8_e4m3fn",)),
     PartFact("v", lambda g: (g.B * g.N, g.H, HEAD), ("float8_e4m3fn",)),
     PartFact("k_scale", lambda g: (g.B * g.N, g.H, HEAD // MXFP8_BLOCK), ("float8_e8m0fnu",)),
     PartFact("v_scale", lambda g: (g.B * g.N, g.H, HEAD // MXFP8_BLOCK), ("float8_e8m0fnu",))),
    (PlaneFact("k", 0, "float8_e4m3fn", lambda g: HEAD, False, True, True, _pool(0, True, 0)),
     PlaneFact("v", 1, "float8_e4m3fn", lambda g: HEAD, False, True, True, _pool(1, True, 0)),
     PlaneFact("k_scale", 2, "float8_e8m0fnu", lambda g: HEAD // MXFP8_BLOCK, False, True, True, _pool(2, True, 0)),
     PlaneFact("v_scale", 3, "float8_e8m0fnu", lambda g: HEAD // MXFP8_BLOCK, False, True, True,
               _pool(3, True, 0)))))

# MHATokenToKVPoolMXFP8 with page_size 128 (mxfp8_sf_interleaved; _create_buffers): K and V as above,
# [size + 128, heads, head_dim], here viewed by page, [pages, 128, heads, head_dim]; the scales of
# each (page, head) in FA4's BlockScaledBasicChunk atom, [pages, heads, 32, 4, head_dim // 32]:
# token n of a page at [n % 32, n // 32] (mxfp8_interleave_sf.py, _read_sf_interleaved).
MXFP8_PAGE, MXFP8_ROWS = 128, 32


def _page(part: int):  # noqa: ANN202 (a PlaneAddress)
    """Value c of K or V by page: [pages, 128, heads, head_dim]."""
    def where(g: Geometry, layer: int, kv: int, slot: int, h: int, c: int):  # noqa: ANN202
        return (part, layer), (slot // MXFP8_PAGE, slot % MXFP8_PAGE, h, c), 0
    return where


def _atom(part: int):  # noqa: ANN202 (a PlaneAddress)
    """Scale c of a token's head in its page's atom: [pages, heads, n % 32, n // 32, c]."""
    def where(g: Geometry, layer: int, kv: int, slot: int, h: int, c: int):  # noqa: ANN202
        n = slot % MXFP8_PAGE
        return (part, layer), (slot // MXFP8_PAGE, h, n % MXFP8_ROWS, n // MXFP8_ROWS, c), 0
    return where


_ATOM = (MXFP8_ROWS, MXFP8_PAGE // MXFP8_ROWS, HEAD // MXFP8_BLOCK)
_register(PartsFact(
    "sglang_mha_mxfp8_interleaved", PAIR_OF_LISTS,
    (PartFact("k", lambda g: (g.B, MXFP8_PAGE, g.H, HEAD), ("float8_e4m3fn",)),
     PartFact("v", lambda g: (g.B, MXFP8_PAGE, g.H, HEAD), ("float8_e4m3fn",)),
     PartFact("k_scale", lambda g: (g.B, g.H, *_ATOM), ("float8_e8m0fnu",)),
     PartFact("v_scale", lambda g: (g.B, g.H, *_ATOM), ("float8_e8m0fnu",))),
    (PlaneFact("k", 0, "float8_e4m3fn", lambda g: HEAD, False, True, True, _page(0)),
     PlaneFact("v", 1, "float8_e4m3fn", lambda g: HEAD, False, True, True, _page(1)),
     PlaneFact("k_scale", 2, "float8_e8m0fnu", lambda g: HEAD // MXFP8_BLOCK, False, True, True, _atom(2)),
     PlaneFact("v_scale", 3, "float8_e8m0fnu", lambda g: HEAD // MXFP8_BLOCK, False, True, True, _atom(3))),
    fixed={"N": MXFP8_PAGE}))

# -- SGLang 0.5.23 MiniMax M3.1 NVFP4 (sglang/srt/mem_cache/minimax_m3_nvfp4_pool.py) -----------------
# _allocate_page_rows: one uint8 slab [layers, pages, row_bytes]; row (layer, page) is the components
# one after another, each rounded up to _PAGE_ROW_ALIGN (128) bytes (_page_row_layout). Main pool
# (_main_page_components): K [heads, page, head_dim // 2], K scale [heads, page, head_dim // 16], V, V
# scale; index pool (_index_page_components): K [page, 64], K scale [page, 8]. Page size and head_dim
# are 128 (MSA_V1_PAGE_SIZE, the classes' checks); set_quantized_kv_buffer writes slot s of head h at
# [s // page, h, s % page] of each component. Handed over as [pages, 2, heads, page, 72] and
# [pages, page, 72] views of pool.rows (kvgen.integrations.sglang.pools).
MINIMAX_PAGE, MINIMAX_ALIGN = 128, 128
MINIMAX_DATA, MINIMAX_SCALES = HEAD // 2, HEAD // 16
MINIMAX_CELL = MINIMAX_DATA + MINIMAX_SCALES


def _minimax_offsets(heads: int, components: int) -> list[int]:
    """Where each component starts in a page row: [K, K scale] (index), then V, V scale (main)."""
    sizes = [heads * MINIMAX_PAGE * w for w in (MINIMAX_DATA, MINIMAX_SCALES)] * (components // 2)
    out, at = [], 0
    for size in sizes:
        out.append(at)
        at += -(-size // MINIMAX_ALIGN) * MINIMAX_ALIGN
    return out


def _minimax(scale: bool, main: bool):  # noqa: ANN202 (a PlaneAddress)
    """Byte c of the data (or scales) of (slot, head), K or V, in its page row, as SGLang places it."""
    def where(g: Geometry, layer: int, kv: int, slot: int, h: int, c: int):  # noqa: ANN202
        heads = g.H if main else 1
        # [K, K scale, V, V scale] of _minimax_offsets, with kv possibly an index grid
        scales_at, side = _minimax_offsets(heads, 4)[1:3]  # K's scales, then V (one side's bytes)
        start = (kv * side if main else 0) + (scales_at if scale else 0)
        width = MINIMAX_SCALES if scale else MINIMAX_DATA
        byte = start + ((h if main else 0) * MINIMAX_PAGE + slot % MINIMAX_PAGE) * width + c
        cell, col = byte // MINIMAX_CELL, byte % MINIMAX_CELL
        if not main:
            return (layer,), (slot // MINIMAX_PAGE, cell, col), 0
        side, rest = cell // (heads * MINIMAX_PAGE), cell % (heads * MINIMAX_PAGE)
        return (layer,), (slot // MINIMAX_PAGE, side, rest // MINIMAX_PAGE, rest % MINIMAX_PAGE, col), 0
    return where


_register(PartsFact(
    "sglang_minimax_m3_nvfp4", (("list", "L"),),
    (PartFact("", lambda g: (g.B, 2, g.H, MINIMAX_PAGE, MINIMAX_CELL), ("uint8",)),),
    (PlaneFact("values", 0, "fp4_e2m1", lambda g: MINIMAX_DATA, True, True, True, _minimax(False, True)),
     PlaneFact("scale", 0, "float8_e4m3fn", lambda g: MINIMAX_SCALES, True, True, True, _minimax(True, True))),
    fixed={"KV": 2, "N": MINIMAX_PAGE}))
_register(PartsFact(
    "sglang_minimax_m3_nvfp4_index", (("list", "L"),),
    (PartFact("", lambda g: (g.B, MINIMAX_PAGE, MINIMAX_CELL), ("uint8",)),),
    (PlaneFact("values", 0, "fp4_e2m1", lambda g: MINIMAX_DATA, False, False, True, _minimax(False, False)),
     PlaneFact("scale", 0, "float8_e4m3fn", lambda g: MINIMAX_SCALES, False, False, True, _minimax(True, False))),
    fixed={"N": MINIMAX_PAGE}))

# -- vLLM 0.33 TURBOQUANT modes (v1/attention/backends/turboquant_attn.py, ops/triton_turboquant_store.py) --
# One slot per (token, head), K and V together, in LBNHC pages [B, N, H, slot], as TurboQuantConfig
# (quantization/turboquant/config.py) sizes it: key_packed_size (fp8 keys: head_dim bytes; MSE keys:
# ceil(head_dim * bits / 8) index bytes, then an fp16 norm), then value_packed_size (ceil(head_dim *
# bits / 8) code bytes, then the fp16 scale and zero); slot_size_aligned rounds up to even. K8V4:
# 128 + 64 + 4 = 196; 4BIT_NC: 64 + 2 + 64 + 4 = 134; K3V4_NC: 48 + 2 + 64 + 4 = 118; 3BIT_NC:
# 48 + 2 + 48 + 4 = 102 (head size 128). 4-bit codes pack two per byte, code 2j low; 3-bit codes
# eight per three bytes, code j of a group at bit 3j of its little-endian 24 bits.
TQ_HALF = 2
#: Per mode: (key bits, value bits); 8-bit keys are fp8 and carry no norm.
TQ_MODES = {"vllm_turboquant_k8v4": (8, 4), "vllm_turboquant_4bit_nc": (4, 4), "vllm_turboquant_k3v4_nc": (3, 4),
            "vllm_turboquant_3bit_nc": (3, 3)}
TQ_TYPES = {8: "float8_e4m3fn", 4: "uint4", 3: "uint3"}


def _turboquant(start: int, size: int):  # noqa: ANN202 (a PlaneAddress)
    return lambda g, layer, kv, slot, h, c: ((layer,), (slot // g.N, slot % g.N, h, start + c * size), 0)


def tq_fields(key_bits: int, value_bits: int) -> list[tuple[str, str, int, int]]:
    """The slot's fields in order: (name, dtype, bytes, bytes per addressed unit)."""
    key = [("key", TQ_TYPES[key_bits], HEAD * key_bits // 8, 1)] + \
        ([("norm", "float16", TQ_HALF, TQ_HALF)] if key_bits < 8 else [])
    return [*key, ("values", TQ_TYPES[value_bits], HEAD * value_bits // 8, 1), ("scale", "float16", TQ_HALF, TQ_HALF),
            ("zero", "float16", TQ_HALF, TQ_HALF)]


def _register_turboquant(name: str, key_bits: int, value_bits: int) -> None:
    fields = tq_fields(key_bits, value_bits)
    slot = sum(f[2] for f in fields)
    slot += slot % 2  # slot_size_aligned
    planes, at = [], 0
    for field, dtype, nbytes, size in fields:
        units = nbytes // size
        planes.append(PlaneFact(field, 0, dtype, lambda g, units=units: units, False, True, True,
                                _turboquant(at, size)))
        at += nbytes
    _register(PartsFact(name, (("list", "L"),), (PartFact("", lambda g: (g.B, g.N, g.H, slot), ("uint8",)),),
                        tuple(planes)))


for _name, (_key_bits, _value_bits) in TQ_MODES.items():
    _register_turboquant(_name, _key_bits, _value_bits)


# -- vLLM 0.33 NVFP4_DS_MLA (v1/attention/backends/mla/flashmla_sparse.py, layers/attention/mla_attention.py) --
# [B, 1, N, 352] uint8, one row per token: 512 e2m1 NoPE values in 256 bytes (low nibble the even
# element), 64 fp8 RoPE values, 32 fp8 NoPE scales (one per 16 elements, permuted in the row).
DS_MLA_NOPE, DS_MLA_ROPE, DS_MLA_SCALES = 512 // 2, 64, 32
DS_MLA_ROW = DS_MLA_NOPE + DS_MLA_ROPE + DS_MLA_SCALES


def _ds_mla(start: int):  # noqa: ANN202 (a PlaneAddress)
    return lambda g, layer, kv, slot, h, c: ((layer,), (slot // g.N, 0, slot % g.N, start + c), 0)


_register(PartsFact(
    "vllm_nvfp4_ds_mla", (("list", "L"),), (PartFact("", lambda g: (g.B, 1, g.N, DS_MLA_ROW), ("uint8",)),),
    (PlaneFact("nope", 0, "fp4_e2m1", lambda g: DS_MLA_NOPE, False, False, True, _ds_mla(0)),
     PlaneFact("rope", 0, "float8_e4m3fn", lambda g: DS_MLA_ROPE, False, False, True, _ds_mla(DS_MLA_NOPE)),
     PlaneFact("scale", 0, "float8_e4m3fn", lambda g: DS_MLA_SCALES, False, False, True,
               _ds_mla(DS_MLA_NOPE + DS_MLA_ROPE)))))


# -- vLLM 0.33 ULTRAQUANT_4BIT (v1/attention/backends/ultraquant_attn.py, ops/ultraquant/format.py) ------
# One slot per (token, head) in LBNHC pages [B, N, H, slot]: K codes (head_dim // 2 bytes, fp4, code 2j
# low), K scales (UE8M0, one per 32), V codes, V scales; slot_size 136 for head size 128.
UQ_GROUP = 32
UQ_FIELDS = (("key", "fp4_e2m1", HEAD // 2), ("key_scale", "ue8m0", HEAD // UQ_GROUP),
             ("values", "fp4_e2m1", HEAD // 2), ("value_scale", "ue8m0", HEAD // UQ_GROUP))
UQ_SLOT = sum(f[2] for f in UQ_FIELDS)


def _uq_planes() -> tuple[PlaneFact, ...]:
    out, at = [], 0
    for name, dtype, nbytes in UQ_FIELDS:
        out.append(PlaneFact(name, 0, dtype, lambda g, n=nbytes: n, False, True, True, _turboquant(at, 1)))
        at += nbytes
    return tuple(out)


_register(PartsFact("vllm_ultraquant_4bit", (("list", "L"),),
                    (PartFact("", lambda g: (g.B, g.N, g.H, UQ_SLOT), ("uint8",)),), _uq_planes()))


# -- vLLM 0.33 OCTAVE modes (v1/attention/backends/rocm_octave_attn.py, ops/rocm_octave.py) -------------
# One slot per (token, KV head), OctaveFormat.slot_bytes, for the kernels' head size 256 and rotary dim
# 64, in LBHNC pages [B, H, N, slot]: k_rope codes (rope_dim * 4 / 8 bytes; none for compact K), k_nope
# codes (the other dims * 3 / 8), v codes (256 * v_bits / 8), fp16 scales (one per 64-dim K block, or
# one for compact K, then V's), padded to 8 bytes (compact: 4).
OCTAVE_HEAD, OCTAVE_ROPE, OCTAVE_BLOCK = 256, 64, 64


def octave_fields(v_bits: int, compact: bool) -> list[tuple[str, str, int, int]]:
    """The slot's fields in order: (name, dtype, bytes, bytes per addressed unit)."""
    wide = 0 if compact else OCTAVE_ROPE
    scales = (1 if compact else OCTAVE_HEAD // OCTAVE_BLOCK) + 1
    out = [("k_rope", "uint8", wide * 4 // 8, 1)] if wide else []
    out += [("k_nope", "uint8", (OCTAVE_HEAD - wide) * 3 // 8, 1), ("v_codes", "uint8", OCTAVE_HEAD * v_bits // 8, 1),
            ("scales", "float16", 2 * scales, 2)]
    raw = sum(f[2] for f in out)
    align = 4 if compact else 8
    pad = -raw % align
    return out + ([("pad", "uint8", pad, 1)] if pad else [])


def _octave(start: int, size: int):  # noqa: ANN202 (a PlaneAddress)
    return lambda g, layer, kv, slot, h, c: ((layer,), (slot // g.N, h, slot % g.N, start + c * size), 0)


def _register_octave(name: str, v_bits: int, compact: bool) -> None:
    fields = octave_fields(v_bits, compact)
    slot = sum(f[2] for f in fields)
    planes, at = [], 0
    for field, dtype, nbytes, size in fields:
        planes.append(PlaneFact(field, 0, dtype, lambda g, units=nbytes // size: units, False, True, True,
                                _octave(at, size)))
        at += nbytes
    _register(PartsFact(name, (("list", "L"),), (PartFact("", lambda g: (g.B, g.H, g.N, slot), ("uint8",)),),
                        tuple(planes)))


_register_octave("vllm_octave_k3v4", 4, False)
_register_octave("vllm_octave_k3v3", 3, False)
_register_octave("vllm_octave_k3v3_compact", 3, True)


# -- vLLM 0.33 DeepSeek-V4 (vllm/models/deepseek_v4/attention.py, xpu/xpu_sparse_decode_fp8.py) ---------
# fp8_ds_mla pages, one head slot, logical [B, 1, N, 584] uint8: block b's bytes hold token n's 576
# data bytes (448 fp8 NoPE, 64 bf16 RoPE) at n * 576, then its 8 scale bytes at N * 576 + n * 8.
# Indexer keys [B, 1, N, 132]: values at n * 128, the fp32 scale at N * 128 + n * 4.
DSV4_ROW, DSV4_DATA, DSV4_SCALE = 584, 576, 8
DSV4_INDEX_ROW = 132
# MXFP4 indexer keys [B, 1, N, 68] (the compressor's MXFP4 writer): every token's 64 packed bytes at
# n * 64, then its 4 UE8M0 scale bytes at N * 64 + n * 4.
DSV4_FP4_ROW, DSV4_FP4_DATA, DSV4_FP4_SCALES = 68, HEAD // 2, HEAD // 32


def _dsv4(row: int, region: int, per_token: int):  # noqa: ANN202 (a PlaneAddress)
    """Byte c of (slot, head) in its block, a run over every head's cells (vLLM keeps one head slot):
    every cell's data, then every cell's scales."""
    def where(g: Geometry, layer: int, kv: int, slot: int, h: int, c: int):  # noqa: ANN202
        byte = region * g.H * g.N + (h * g.N + slot % g.N) * per_token + c
        return (layer,), (slot // g.N, byte // (g.N * row), byte % (g.N * row) // row, byte % row), 0
    return where


_register(PartsFact(
    "vllm_dsv4_mla_fp8", (("list", "L"),), (PartFact("", lambda g: (g.B, g.H, g.N, DSV4_ROW), ("uint8",)),),
    (PlaneFact("data", 0, "uint8", lambda g: DSV4_DATA, False, True, True, _dsv4(DSV4_ROW, 0, DSV4_DATA)),
     PlaneFact("scale", 0, "uint8", lambda g: DSV4_SCALE, False, True, True, _dsv4(DSV4_ROW, DSV4_DATA, DSV4_SCALE))),
    fixed={"H": 1}))
_register(PartsFact(
    "vllm_dsv4_indexer", (("list", "L"),), (PartFact("", lambda g: (g.B, g.H, g.N, DSV4_INDEX_ROW), ("uint8",)),),
    (PlaneFact("values", 0, "float8_e4m3fn", lambda g: HEAD, False, True, True, _dsv4(DSV4_INDEX_ROW, 0, HEAD)),
     PlaneFact("scale", 0, "float32", lambda g: 1, False, True, True, _dsv4(DSV4_INDEX_ROW, HEAD, SCALE))),
    fixed={"H": 1}))
_register(PartsFact(
    "vllm_dsv4_indexer_mxfp4", (("list", "L"),), (PartFact("", lambda g: (g.B, g.H, g.N, DSV4_FP4_ROW), ("uint8",)),),
    (PlaneFact("values", 0, "fp4_e2m1", lambda g: DSV4_FP4_DATA, False, True, True,
               _dsv4(DSV4_FP4_ROW, 0, DSV4_FP4_DATA)),
     PlaneFact("scale", 0, "ue8m0", lambda g: DSV4_FP4_SCALES, False, True, True,
               _dsv4(DSV4_FP4_ROW, DSV4_FP4_DATA, DSV4_FP4_SCALES))),
    fixed={"H": 1}))


# -- packed units: packing order and scale groups, from the same sources ------------------------------
#: Per spec and plane: (packing of a sub-byte plane, the plane a scale plane scales, values per scale).
#: vLLM: pack_int4_nibbles and break_fp4_bytes put value 2j low; the Triton modes keep one fp32 scale
#: per head and token (a group of the whole head), NVFP4 one fp8 scale per 16 values. SGLang's
#: FP4MXBlock16KVQuantizeUtil packs low first; its UE8M0 scales are tensors of their own (parts).
UNITS: dict[str, dict[str, tuple[str | None, str | None, int | None]]] = {
    "vllm_int8_per_token_head": {"values": (None, None, None), "scale": (None, "values", HEAD)},
    "vllm_fp8_per_token_head": {"values": (None, None, None), "scale": (None, "values", HEAD)},
    "vllm_int4_per_token_head": {"values": ("low_first", None, None), "scale": (None, "values", HEAD)},
    "vllm_nvfp4": {"values": ("low_first", None, None), "scale": (None, "values", 16)},
    "vllm_nvfp4_nhd": {"values": ("low_first", None, None), "scale": (None, "values", 16)},
    "vllm_ultraquant_4bit": {"key": ("low_first", None, None), "key_scale": (None, "key", UQ_GROUP),
                             "values": ("low_first", None, None), "value_scale": (None, "values", UQ_GROUP)},
    # NVFP4_DS_MLA: its scales are permuted in the row (8 * (s & 3) + (s >> 2)), no format-3 group.
    "vllm_nvfp4_ds_mla": {"nope": ("low_first", None, None), "rope": (None, None, None), "scale": (None, None, None)},
    # TurboQuant: one fp16 scale (and zero) per head's values; the fp8 keys carry no scale, the MSE
    # keys' fp16 norm scales the head's key (its centroids, rotated back).
    "vllm_turboquant_k8v4": {"key": (None, None, None), "values": ("low_first", None, None),
                             "scale": (None, "values", HEAD), "zero": (None, None, None)},
    **{name: {"key": ("low_first", None, None), "norm": (None, "key", HEAD), "values": ("low_first", None, None),
              "scale": (None, "values", HEAD), "zero": (None, None, None)}
       for name in ("vllm_turboquant_4bit_nc", "vllm_turboquant_k3v4_nc", "vllm_turboquant_3bit_nc")},
    "sglang_mha_fp4": {"k.values": ("low_first", None, None), "v.values": ("low_first", None, None),
                       "k_scale": (None, None, None), "v_scale": (None, None, None)},
    "sglang_mla_fp4": {"kv.values": ("low_first", None, None), "scale": (None, None, None)},
    # SGLang's NVFP4KVQuantizeUtil (MiniMax M3.1 pools): value 2j low, one fp8 e4m3 scale per 16 values.
    "sglang_minimax_m3_nvfp4": {"values": ("low_first", None, None), "scale": (None, "values", 16)},
    "sglang_minimax_m3_nvfp4_index": {"values": ("low_first", None, None), "scale": (None, "values", 16)},
    # DeepSeek-V4's MXFP4 indexer writer packs each (even, odd) pair low first, one UE8M0 per 32 values
    "vllm_dsv4_indexer_mxfp4": {"values": ("low_first", None, None), "scale": (None, "values", 32)},
}


def units_disagreement(spec: Spec) -> str | None:
    """The first plane whose packing or scale group differs from the sources, or None."""
    want = UNITS.get(spec.name)
    if want is None:
        return f"no packed-unit facts for {spec.name}"
    for plane in spec.moved_planes():
        f = plane.field
        got = (str(f.packing) if f and f.packing else None, f.scales if f else None, f.group if f else None)
        if want.get(plane.name) != got:
            return f"plane {plane.name}: packing, scales, group {got}, the source says {want.get(plane.name)}"
    return None
