"""Quantization as detection reads it: the hints that say how an engine quantized its cache,
and whether a spec's `quant:` agrees.

A quantized cache's bytes can often be read two ways (vLLM's FP8_PER_TOKEN_HEAD cache of head
size 128 is a uint8 [B, H, N, 264] view, as is a plain fp8 cache of head size 132), so its tensors
do not decide: the engine's own words do. vLLM states `kv_quant_mode` (a KVQuantMode member, or
its name) or `kv_cache_dtype` (the string it maps to one); SGLang states its pool class. A spec
without `quant:` is an unquantized cache (vLLM's NONE or FP8_PER_TENSOR: the scales are the
layer's, not the cache's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvgen.errors import KVLayoutError

#: The hints this module reads.
QUANT_HINTS = ("kv_quant_mode", "kv_cache_dtype", "pool")
#: vLLM 0.33's kv_cache_dtype strings and the KVQuantMode each maps to (vllm/v1/kv_cache_interface.py
#: get_kv_quant_mode: exact names first, then the nvfp4, turboquant_, octave_ and fp8 prefixes).
VLLM_CACHE_DTYPES = {"int4_per_token_head": "INT4_PER_TOKEN_HEAD", "int8_per_token_head": "INT8_PER_TOKEN_HEAD",
                     "fp8_per_token_head": "FP8_PER_TOKEN_HEAD", "nvfp4_ds_mla": "NVFP4_DS_MLA",
                     "ultraquant_4bit": "ULTRAQUANT_4BIT"}
#: Modes whose scales live outside the cache (the layer's per-tensor scales), read as unquantized.
UNQUANTIZED = ("NONE", "FP8_PER_TENSOR")
#: Modes that pack a token's K and V into one slot per head (vLLM 0.33 KVQuantMode: "packed K+V per slot";
#: UltraQuant's backend is a TurboQuant backend whose slot holds K codes and scales, then V's).
PACKED_KV_PREFIXES = ("TURBOQUANT_", "OCTAVE_", "ULTRAQUANT_")


def packs_k_and_v(mode: str) -> bool:
    """Whether a KVQuantMode name keeps K and V in one slot (one plane of bytes, not two)."""
    return str(mode).upper().startswith(PACKED_KV_PREFIXES)


def vllm_mode(kv_cache_dtype: str) -> str:
    """The KVQuantMode name vLLM 0.33 gives a kv_cache_dtype string."""
    name = str(kv_cache_dtype).lower()
    if name in VLLM_CACHE_DTYPES:
        return VLLM_CACHE_DTYPES[name]
    if name.startswith("nvfp4"):
        return "NVFP4"
    if name.startswith(("turboquant_", "octave_")):
        return name.upper()
    return "FP8_PER_TENSOR" if name.startswith("fp8") else "NONE"


def normalize_quant(out: dict[str, Any]) -> None:
    """kv_cache_dtype folded into kv_quant_mode (a KVQuantMode member becomes its name);
    KVLayoutError when the two disagree."""
    mode = out.get("kv_quant_mode")
    if mode is not None:
        out["kv_quant_mode"] = str(getattr(mode, "name", mode)).upper()
    if "kv_cache_dtype" in out:
        said = vllm_mode(out.pop("kv_cache_dtype"))
        if out.setdefault("kv_quant_mode", said) != said:
            raise KVLayoutError(f"hints disagree: kv_quant_mode is {out['kv_quant_mode']!r}, kv_cache_dtype "
                                f"means {said!r}")
    if "pool" in out:
        out["pool"] = str(getattr(out["pool"], "__name__", out["pool"]))


def _stored(quant: Mapping[str, str], engine: str) -> str:
    return quant.get(engine, "NONE")


def quant_mismatch(quant: Mapping[str, str], hints: Mapping[str, Any]) -> str | None:
    """Why a spec with `quant` (engine family -> name) is not the cache the hints describe, or None."""
    mode = hints.get("kv_quant_mode")
    if mode is not None:
        stored = _stored(quant, "vllm")
        same = stored == mode or (stored == "NONE" and mode in UNQUANTIZED)
        if not same:
            return f"kv_quant_mode={mode!r}, the spec stores {'no cache scales' if stored == 'NONE' else stored}"
    pool = hints.get("pool")
    if pool is not None and "sglang" in quant and quant["sglang"] != pool:
        return f"pool={pool!r}, the spec is SGLang's {quant['sglang']}"
    if pool is not None and "sglang" not in quant and _quantized_pool(pool):
        return f"pool={pool!r} quantizes its cache; the spec stores no cache scales"
    return None


def _quantized_pool(pool: str) -> bool:
    """SGLang 0.5.23's pools that keep packed values and scales (sglang/srt/mem_cache/), in any case
    (MiniMaxM3Nvfp4MainKVPool)."""
    return any(word in pool.upper() for word in ("FP4", "MXFP8", "FP8SCALE"))


def quant_deciders(quant: Mapping[str, str], fits: Sequence[Mapping[str, str]]) -> dict[str, Any]:
    """The quantization hint that keeps a spec with `quant` and drops another candidate."""
    out: dict[str, Any] = {}
    if len({_stored(q, "vllm") for q in fits}) > 1:
        out["kv_quant_mode"] = _stored(quant, "vllm")
    if "sglang" in quant and len({q.get("sglang") for q in fits}) > 1:
        out["pool"] = quant["sglang"]
    return out
