"""LMCache's vLLM connectors (kvgen's drop-in) take what LMCache passes on, layout_hints included,
and never guess a layout: vLLM 0.33's per-layer views move with the KVCacheLayout named in
layout_hints, and an ambiguous cache without that hint is refused (issue 19, "Why" 3).

Caches carry codes of their coordinates, so a transposition changes the compared values.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import builtin_library, need_lmcache

need_lmcache()

from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

import kvgen.integrations.lmcache as kl  # noqa: E402
from kvgen.integrations.detect import AmbiguousLayout, NoLayout  # noqa: E402
from kvgen.oracle import reference  # noqa: E402
from kvgen.runtime import MemoryObj  # noqa: E402

LIBRARY = builtin_library()
L, B, N, C = 2, 5, 4, 6
SLOTS = [17, 3, 8, 9, 10, 11, 0]


def _metadata(heads: int) -> LMCacheMetadata:
    return LMCacheMetadata(model_name="kvgen-test", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.float32, use_mla=False,
                           kv_shape=(L, 2, 256, heads, C))


def _store(hints: dict[str, Any] | None, cache: Any, heads: int) -> torch.Tensor:
    conn = kl.VLLMPagedMemGPUConnectorV2.from_metadata(_metadata(heads), device="cpu", layout_hints=hints)
    obj = MemoryObj(torch.zeros(2, L, len(SLOTS), heads * C))
    conn.from_gpu(obj, 0, len(SLOTS), kvcaches=cache, slot_mapping=torch.tensor(SLOTS))
    return obj.tensor


def test_cpu_attention_cache_with_heads_equal_to_block_size_and_no_hint_is_refused() -> None:
    """vLLM's CPU attention (before 0.33) keeps [2, B, H, N, C] with heads before slots; with H == N
    the shape and contiguous strides cannot say which is which, and LMCache passed no kv_layout."""
    spec = LIBRARY["vllm_flash_attn_hnd"]
    ext = {"L": L, "KV": 2, "B": B, "N": N, "H": N, "C": C}
    cache = [torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape) + 1 + i * t.numel()
             for i, t in enumerate(torch.zeros(L, *reference.layouts.leaf_shape(spec, ext)))]
    for release in ({"engine_version": "0.32.0"}, {}):  # an older vLLM, and the installed one
        with pytest.raises((AmbiguousLayout, NoLayout)):
            _store(release or None, cache, heads=N)
    with pytest.raises(AmbiguousLayout, match="kv_layout='HND'"):
        _store({"engine_version": "0.32.0"}, cache, heads=N)
    got = _store({"engine_version": "0.32.0", "kv_layout": "HND"}, cache, heads=N)
    want = torch.zeros_like(got)
    reference.store(spec, LIBRARY["kv_2ltd"], ext, cache, want, reference.Span(SLOTS, 0, len(SLOTS)))
    assert torch.equal(got, want)


def test_vllm_033_views_move_with_the_kv_cache_layout_in_layout_hints() -> None:
    vllm = pytest.importorskip("vllm.v1.kv_cache_layout", reason="vllm 0.33.0 is not installed (scripts/dev "
                               "installs it unless KVGEN_NO_ENGINES=1)")
    heads = 3
    for layout in vllm.KVCacheLayout:
        order = layout.layer_view_order  # memory order of the logical [B, H, N, C]
        logical = (B, heads, N, 2 * C)
        memory = [torch.arange(B * heads * N * 2 * C, dtype=torch.float32).reshape([logical[i] for i in order])
                  + 1 + i * 10000 for i in range(L)]
        views = [m.permute(*[order.index(d) for d in range(4)]) for m in memory]  # what vLLM hands over
        if layout.name != "LHBNC":  # its layers' views are alike those of another layout: the hint decides
            with pytest.raises(AmbiguousLayout, match=f"kv_layout='{layout.name}'"):
                _store({"engine_version": "0.33.0"}, views, heads)
        got = _store({"engine_version": "0.33.0", "kv_layout": layout.name}, views, heads)
        want = torch.stack([torch.stack([torch.stack([v[s // N, :, s % N, k * C:(k + 1) * C].reshape(-1)
                                                      for s in SLOTS]) for v in views]) for k in range(2)])
        assert torch.equal(got, want), layout.name
