"""The hints that tell apart the layouts an ambiguous cache fits: what a refusal suggests.

Each candidate gets the hints that keep it and drop at least one other candidate: an extent
the candidates read differently, the engine's own name for the layout (vLLM's KVCacheLayout,
SGLang's kv_cache_layout), MLA or not, the engine, its backend or release; `layout` always
decides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvgen.integrations.hints import AXIS_HINTS, VLLM_LAYER_ORDERS
from kvgen.integrations.quant import quant_deciders
from kvgen.integrations.sglang import layouts as sglang_layouts
from kvgen.versions import some_release

__all__ = ["deciders", "extents"]


def extents(ext: Mapping[str, int]) -> str:
    return "[" + " ".join(f"{k}={v}" for k, v in ext.items()) + "]"


Fits = Sequence[tuple[Any, Mapping[str, int]]]


def _extent_hints(f: Any, ext: Mapping[str, int], fits: Fits) -> dict[str, Any]:
    """The extents the candidates read differently (not for an SGLang pool: its word decides)."""
    if sglang_layouts.word_of(f) is not None:
        return {}
    return {hint: ext[axis] for axis, hint in AXIS_HINTS
            if axis in ext and len({e.get(axis) for _, e in fits}) > 1}


def _layout_word(f: Any, fits: Fits) -> str | None:
    """The kv_layout that names `f`: SGLang's word, vLLM's KVCacheLayout name, or its NHD/HND order."""
    word = sglang_layouts.word_of(f)
    if word is not None:
        return word  # the pool's kv_cache_layout: the only fact that orders SGLang's 4-D buffers
    if f.given and f.aliases:
        return f.aliases[0]  # the engine's own name for the layout (vLLM's KVCacheLayout)
    if f.given and f.slots_per_token > 1:  # a pooled vLLM cache: a KVCacheLayout of its order
        return next((name for name, order in VLLM_LAYER_ORDERS.items() if order == f.block_order()), None)
    if f.order() and len({g.order() for g, _ in fits}) > 1 and not _names_a_vllm_layout(f):
        return f.order()
    return None


def _engine_hints(f: Any, fits: Fits) -> dict[str, Any]:
    """MLA or not, the engine, its backend and release, where they tell `f` from another candidate."""
    out: dict[str, Any] = {}
    if len({g.planes for g, _ in fits}) > 1:
        out["use_mla"] = f.planes == 1
    if len({frozenset(g.families()) for g, _ in fits}) > 1 and len(f.families()) == 1:
        out["engine"] = next(iter(f.families()))
    others = [g.backends() for g, _ in fits if g.name != f.name]
    own = sorted(b for b in f.backends() if not all(b in o for o in others))
    if own:
        out["backend"] = own[0]
    if f.versions and len(f.families()) == 1:  # detection for that engine keeps only its releases' specs
        engine = next(iter(f.families()))
        if engine in f.versions:
            out.setdefault("engine", engine)
            out["engine_version"] = some_release(f.versions[engine])
    return out


def deciders(f: Any, ext: Mapping[str, int], fits: Fits) -> dict[str, Any]:
    """Hints that keep `f` and drop at least one other candidate (`layout` always decides)."""
    out = _extent_hints(f, ext, fits)
    word = _layout_word(f, fits)
    if word is not None:
        out["kv_layout"] = word
    out.update(quant_deciders(f.quant, [g.quant for g, _ in fits]))
    return {**out, **_engine_hints(f, fits), "layout": f.name}


def _names_a_vllm_layout(f: Any) -> bool:
    """Whether NHD or HND would name a KVCacheLayout rather than `f`'s in-block order: from vLLM
    0.33 they are LBNHC and LBHNC, so they order only a vLLM spec whose releases predate that
    (its suggested engine_version says so); a vLLM spec that names no release is told by others."""
    return "vllm" in f.families() and "vllm" not in f.versions
