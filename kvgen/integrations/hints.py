"""The hints detection takes: what an engine states about its cache (engine, version,
KVCacheLayout or in-block order, extents), under their canonical names."""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from importlib import metadata
from typing import Any

from kvgen.errors import KVLayoutError
from kvgen.integrations.quant import QUANT_HINTS, normalize_quant
from kvgen.versions import release

#: Hints `detect` understands (LMCache's LayoutHints keys are among them).
HINTS = ("engine", "backend", "kv_layout", "given_order", "num_blocks", "num_kv_heads", "block_size",
         "head_size", "hidden_dim", "num_layers", "use_mla", "kv_shape", "layout", "dtype", "kv_list_layout",
         "engine_version", "tokens_per_state", *QUANT_HINTS)
#: Other names engines use for the same facts.
SYNONYMS = {"tokens_per_block": "block_size", "page_size": "block_size", "head_dim": "head_size"}
#: The hint that states each axis's extent.
AXIS_HINTS = (("L", "num_layers"), ("B", "num_blocks"), ("H", "num_kv_heads"), ("N", "block_size"),
              ("C", "head_size"))
#: In-block orders a `kv_layout` hint may name (anything else names a spec).
ORDERS = {"NHD": ("N", "H"), "HND": ("H", "N")}


def family(name: str) -> str:
    name = str(getattr(name, "value", name)).lower().replace("-", "_")
    if name in ("tensorrt_llm", "tensorrtllm", "trt_llm"):
        return "trtllm"
    return name.split("_")[0] if name.startswith("vllm_") else name


def normalize_hints(hints: Mapping[str, Any]) -> dict[str, Any]:
    """Hints under their canonical names, with kv_shape and use_mla unfolded; TypeError on
    an unknown name, KVLayoutError when two hints disagree."""
    out: dict[str, Any] = {}
    for key, value in hints.items():
        name = SYNONYMS.get(key, key)
        if name not in HINTS:
            raise TypeError(f"detect() got an unknown hint {key!r}; hints: {', '.join(HINTS + tuple(SYNONYMS))}")
        if value is None:
            continue
        if name in out and out[name] != value:
            raise KVLayoutError(f"hints disagree: {name} is {out[name]!r} and {value!r}")
        out[name] = value
    for key, value in _derived(out).items():
        if key in out and out[key] != value:
            raise KVLayoutError(f"hints disagree: {key}={out[key]!r}, but kv_shape says {value!r}")
        out.setdefault(key, value)
    out.pop("kv_list_layout", None)  # SGLang's list organisation: the list levels already say it
    if "tokens_per_state" in out:  # vLLM's int | Fraction (a string such as "1/4" reads the same)
        out["tokens_per_state"] = _fraction(out["tokens_per_state"])
    normalize_quant(out)
    return out


def _derived(out: dict[str, Any]) -> dict[str, Any]:
    """The hints kv_shape and use_mla stand for, taking both out of `out`."""
    derived: dict[str, Any] = {}
    if "kv_shape" in out:
        kv_shape = tuple(int(x) for x in out.pop("kv_shape"))
        if len(kv_shape) != 5:
            raise KVLayoutError(f"kv_shape must be (num_layers, 2 or 1, chunk_size, num_kv_heads, head_size), "
                                f"got {kv_shape}")
        derived.update(num_layers=kv_shape[0], planes=kv_shape[1], num_kv_heads=kv_shape[3],
                       head_size=kv_shape[4])
    if "use_mla" in out:
        planes = 1 if out.pop("use_mla") else 2
        if derived.get("planes", planes) != planes:
            raise KVLayoutError(f"hints disagree: use_mla says {planes} plane(s), kv_shape {derived['planes']}")
        derived["planes"] = planes
    return derived


def _fraction(value: Any) -> Fraction:
    try:
        ratio = Fraction(value)
    except (TypeError, ValueError, ZeroDivisionError):
        raise KVLayoutError(f"tokens_per_state must be a positive int or Fraction (vLLM's AttentionSpec), "
                            f"got {value!r}") from None
    if ratio <= 0:
        raise KVLayoutError(f"tokens_per_state must be positive, got {value!r}")
    return ratio


def describe_hints(hints: Mapping[str, Any]) -> str:
    shown = {k: (family(v) if k == "engine" else v) for k, v in hints.items() if k != "planes"}
    if "planes" in hints:
        shown["use_mla"] = hints["planes"] == 1
    return ", ".join(f"{k}={v!r}" for k, v in sorted(shown.items())) or "none"


#: vLLM's KVCacheLayout names (vllm/v1/kv_cache_layout.py), a cache's declared layout from 0.33 on.
VLLM_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
#: Each KVCacheLayout's per-layer memory order of blocks, heads and slots (layer_view_order): what a
#: layout without a name of its own (a pooled cache's) must follow to be that layout's.
VLLM_LAYER_ORDERS = {"LBHNC": ("B", "H", "N"), "LBNHC": ("B", "N", "H"), "LHBNC": ("H", "B", "N"),
                     "BLHNC": ("B", "H", "N"), "BLNHC": ("B", "N", "H"), "BHLNC": ("B", "H", "N")}
#: The legacy names vLLM 0.33 maps onto KVCacheLayouts; before 0.33 they name an in-block order.
VLLM_LEGACY = {"NHD": "LBNHC", "HND": "LBHNC"}
#: The first vLLM release that hands every layer over as a logical [B, H, N, C] view.
VLLM_LAYOUTS_SINCE = (0, 33, 0)
#: What a KVCacheLayout name meant before 0.33 (physical views; blocks-outermost layouts as one
#: tensor): the built-in specs that carried these names as aliases then.
VLLM_LAYOUTS_BEFORE = {"LBNHC": "vllm_packed_nhd", "LBHNC": "vllm_packed_hnd", "LHBNC": "vllm_heads_first",
                       "BLNHC": "vllm_blocks_first_nhd", "BLHNC": "vllm_blocks_first_hnd",
                       "BHLNC": "vllm_blocks_heads_first"}


def engine_version(hints: Mapping[str, Any]) -> str | None:
    """The engine release detection considers: the `engine_version` hint, else, for vLLM, the
    installed vllm's version (the engine in this process), else None (every release)."""
    if hints.get("engine_version") is not None:
        version = str(hints["engine_version"])
        try:
            release(version)
        except ValueError as exc:
            raise KVLayoutError(f"engine_version={version!r}: expected release numbers such as 0.33.0") from exc
        return version
    if hints.get("engine") is not None:
        return installed_version(family(hints["engine"]))
    return None


def installed_version(engine: str) -> str | None:
    """The release of `engine` installed beside kvgen, for the engines whose release decides the
    layout (vLLM); None when it is not installed or its release says nothing."""
    if engine != "vllm":
        return None
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def declared_vllm_layout(kv_layout: Any, engine: str | None, version: str | None) -> str | None:
    """The KVCacheLayout a `kv_layout` hint names: one of vLLM's names, or NHD / HND from vLLM
    0.33 on (where they are legacy names of LBNHC / LBHNC); None when it names something else
    (for a vLLM release before 0.33, a KVCacheLayout name names the spec of that time)."""
    if kv_layout is None:
        return None
    name = str(getattr(kv_layout, "name", kv_layout)).upper()  # vLLM's KVCacheLayout enum or its name
    before = engine == "vllm" and version is not None and release(version) < VLLM_LAYOUTS_SINCE
    if name in VLLM_LAYOUTS and not before:
        return name
    if name in VLLM_LEGACY and engine == "vllm" and version is not None and release(version) >= VLLM_LAYOUTS_SINCE:
        return VLLM_LEGACY[name]
    return None
