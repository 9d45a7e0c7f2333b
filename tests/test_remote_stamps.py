"""Stamps checked on load: a connector given its cache's description (`remote.check_loads`)
refuses, in its own load and before any write, a memory object stamped from a cache of another
layout, TP split or spec version; an object of its own stamp, or of none, loads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvgen import generated, remote
from kvgen.runtime import MemoryObj
from kvgen.runtime.errors import KVLayoutError

TOKENS = 8


def _coded(layout: str, heads: int) -> list[torch.Tensor]:
    """A 2-layer cache whose every element is its own flat index plus 1 (never zero)."""
    shape = (2, 4, 16, heads, 8) if layout == "vllm_flash_attn_nhd" else (2, 4, heads, 16, 8)
    n = torch.Size(shape).numel()
    return [torch.arange(1 + k * n, 1 + (k + 1) * n, dtype=torch.float32).reshape(shape) for k in range(2)]


def _stored(layout: str, heads: int, tp_size: int, **changed: str) -> tuple[MemoryObj, remote.CacheDescription]:
    """A kv_2ltd object of TOKENS tokens stored from a coded cache of `layout`, stamped with its
    description (fields `changed` replaced: another spec version's digest)."""
    caches = _coded(layout, heads)
    d = dataclasses.replace(remote.describe(caches, layout, tp_rank=0, tp_size=tp_size), **changed)
    conn = generated.get(layout, "kv_2ltd")()
    obj = MemoryObj(torch.zeros(tuple(conn.get_shape(TOKENS, caches))))
    conn.from_gpu(obj, 0, TOKENS, kvcaches=caches, slot_mapping=torch.arange(TOKENS))
    remote.stamp(obj, d)
    return obj, d


def _loader(heads: int = 4) -> tuple[object, list[torch.Tensor], remote.CacheDescription]:
    """The loading side: an NHD cache of zeros, TP 1 of 4 heads, whose connector checks loads."""
    caches = [torch.zeros(2, 4, 16, heads, 8) for _ in range(2)]
    d = remote.describe(caches, "vllm_flash_attn_nhd", tp_rank=0, tp_size=1)
    conn = generated.get("vllm_flash_attn_nhd", "kv_2ltd")()
    remote.check_loads(conn, d)
    return conn, caches, d


def _load(conn: object, obj: MemoryObj, caches: list[torch.Tensor]) -> None:
    conn.to_gpu(obj, 0, TOKENS, kvcaches=caches, slot_mapping=torch.arange(TOKENS))  # type: ignore[attr-defined]


def test_an_object_of_the_same_stamp_loads_element_by_element() -> None:
    conn, caches, _ = _loader()
    obj, _ = _stored("vllm_flash_attn_nhd", 4, 1)
    _load(conn, obj, caches)
    want = _coded("vllm_flash_attn_nhd", 4)
    for got, src in zip(caches, want, strict=True):
        flat_src, flat_got = src.reshape(2, 64, 4, 8), got.reshape(2, 64, 4, 8)
        assert torch.equal(flat_got[:, :TOKENS], flat_src[:, :TOKENS])
        assert not flat_got[:, TOKENS:].any()


def test_an_unstamped_object_loads() -> None:
    conn, caches, _ = _loader()
    obj, _ = _stored("vllm_flash_attn_nhd", 4, 1)
    obj.metadata.fingerprint = None  # what stored it did not say
    _load(conn, obj, caches)
    assert caches[0].reshape(2, 64, 4, 8)[0, 0, 0, 0] == 1


@pytest.mark.parametrize(("what", "layout", "tp_size", "changed"), [
    ("layout", "vllm_flash_attn_hnd", 1, {}),      # same object shape, another cache layout
    ("tp", "vllm_flash_attn_nhd", 2, {}),          # 4 heads of 8 over 2 ranks, not 4 of 4
    ("digest", "vllm_flash_attn_nhd", 1, {"digest": "0123456789abcdef"}),  # another spec version
])
def test_an_object_stamped_from_another_cache_is_refused_before_any_write(
        what: str, layout: str, tp_size: int, changed: dict[str, str]) -> None:
    conn, caches, here = _loader()
    obj, theirs = _stored(layout, 4, tp_size, **changed)
    assert theirs.fingerprint != here.fingerprint, what
    with pytest.raises(KVLayoutError, match=f"stored from a cache of layout fingerprint {theirs.fingerprint}, "
                                            f"this cache's is {here.fingerprint}"):
        _load(conn, obj, caches)
    assert not any(t.any() for t in caches)  # nothing written


def test_a_connector_that_checks_no_loads_loads_any_stamp() -> None:
    conn = generated.get("vllm_flash_attn_nhd", "kv_2ltd")()
    caches = [torch.zeros(2, 4, 16, 4, 8) for _ in range(2)]
    obj, _ = _stored("vllm_flash_attn_nhd", 4, 2)
    _load(conn, obj, caches)
    assert caches[0].any()


def test_check_loads_refuses_a_description_of_another_layout() -> None:
    conn = generated.get("vllm_flash_attn_nhd", "kv_2ltd")()
    hnd = remote.describe(_coded("vllm_flash_attn_hnd", 4), "vllm_flash_attn_hnd", tp_rank=0, tp_size=1)
    with pytest.raises(KVLayoutError, match="describes a vllm_flash_attn_hnd cache; this connector moves "
                                            "vllm_flash_attn_nhd"):
        remote.check_loads(conn, hnd)
