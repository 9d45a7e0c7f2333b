"""kvgen.remote.describe: what a worker sends in the handshake, its wire form, its
fingerprint, and the refusal of two caches that cannot exchange KV."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvgen import remote
from kvgen.oracle.scenarios.transfers import SRC_EXT
from kvgen.runtime.errors import KVLayoutError
from tests.remote_harness import Case


def _nhd(layers: int = 32, heads: int = 8, dtype: torch.dtype = torch.bfloat16, c: int = 128) -> list[torch.Tensor]:
    return [torch.zeros(2, 4, 16, heads, c, dtype=dtype) for _ in range(layers)]


def test_a_description_carries_addresses_strides_and_the_tp_split() -> None:
    caches = _nhd(layers=2, heads=4, dtype=torch.float16, c=8)
    d = remote.describe(caches, "NHD", tp_rank=1, tp_size=2)  # an alias names the spec
    assert d.spec == "vllm_flash_attn_nhd" and d.dtype == "float16"
    assert dict(d.extents) == {"L": 2, "KV": 2, "H": 4, "C": 8, "S": 64, "N": 16}
    assert d.leaves == tuple(t.data_ptr() for t in caches) and d.span == caches[0].numel() * 2
    # [KV B N H C] in bytes: C 2, H 16, N 64, B 1024, KV 4096; L is the list level.
    assert dict(d.strides) == {"C": 2, "H": 16, "N": 64, "B": 1024, "KV": 4096}
    assert dict(d.steps) == {"L": 1}
    assert (d.tp_rank, d.tp_size, d.num_kv_heads) == (1, 2, 8)
    assert d.regions() == [(t.data_ptr(), caches[0].numel() * 2, 0) for t in caches]


def test_the_wire_form_is_small_json_and_reads_back_equal() -> None:
    d = remote.describe(_nhd(), "vllm_flash_attn_nhd", tp_rank=0, tp_size=1)
    wire = d.to_bytes()
    assert wire.startswith(b"{") and len(wire) < 1024  # 32 leaf addresses and the facts
    assert remote.CacheDescription.from_bytes(wire) == d


def test_garbage_and_other_versions_are_refused() -> None:
    with pytest.raises(KVLayoutError, match="not a kvgen cache description"):
        remote.CacheDescription.from_bytes(b"hello")
    d = remote.describe(_nhd(2), "vllm_flash_attn_nhd", tp_rank=0, tp_size=1)
    with pytest.raises(KVLayoutError, match="version 99"):
        remote.CacheDescription.from_bytes(dataclasses.replace(d, version=99).to_bytes())


def test_the_fingerprint_names_the_layout_not_the_allocation() -> None:
    first, second = _nhd(2), _nhd(2)  # both alive: their tensors are at different addresses
    a = remote.describe(first, "vllm_flash_attn_nhd", tp_rank=0, tp_size=1)
    b = remote.describe(second, "vllm_flash_attn_nhd", tp_rank=0, tp_size=1)
    assert a.leaves != b.leaves and a.fingerprint == b.fingerprint
    others = [remote.describe(_nhd(2, heads=4), "vllm_flash_attn_nhd", tp_rank=0, tp_size=2),
              remote.describe(_nhd(2, dtype=torch.float16), "vllm_flash_attn_nhd", tp_rank=0, tp_size=1),
              remote.describe([t.permute(0, 1, 3, 2, 4).contiguous() for t in _nhd(2)], "vllm_flash_attn_hnd",
                              tp_rank=0, tp_size=1)]
    assert len({a.fingerprint, *(o.fingerprint for o in others)}) == 4


def test_a_cache_that_is_not_the_layout_is_refused() -> None:
    with pytest.raises(KVLayoutError, match="vllm_flash_attn_nhd"):
        remote.describe(torch.zeros(3, 4), "vllm_flash_attn_nhd", tp_rank=0, tp_size=1)
    for kwargs, words in (({"tp_rank": 2, "tp_size": 2}, "not one of the 2 ranks"),
                          ({"tp_rank": 0, "tp_size": 0}, "tp_size must be a positive")):
        with pytest.raises(KVLayoutError, match=words):
            remote.describe(_nhd(2), "vllm_flash_attn_nhd", **kwargs)


def _pair() -> tuple[list[remote.CacheDescription], remote.CacheDescription, list, object]:
    case = Case("vllm_flash_attn_nhd", "vllm_flash_attn_hnd", dict(SRC_EXT), dict(SRC_EXT), 1, 1, 0, 2)
    srcs, dst = case.caches()
    sd, dd = case.describe(srcs, dst)
    return sd, dd, srcs, dst


@pytest.mark.parametrize("field, value, words", [
    ("dtype", "float16", "dtype float16 vs float32"),
    ("extents", None, "head size C 8 vs 4"),
    ("num_kv_heads", 4, "num_kv_heads 4 vs 2"),
    ("digest", "0123456789abcdef", "another version of the spec"),
])
def test_mismatched_descriptions_are_refused_naming_both(field: str, value: object, words: str) -> None:
    sd, dd, _, _ = _pair()
    if field == "extents":
        value = tuple((a, 8 if a == "C" else n) for a, n in sd[0].extents)
    bad = dataclasses.replace(sd[0], **{field: value})
    with pytest.raises(KVLayoutError, match=words) as refused:
        remote.plan(bad, dd, torch.arange(4), torch.arange(4))
    if field != "digest":
        assert "source vllm_flash_attn_nhd" in str(refused.value) and "destination vllm_flash_attn_hnd" in \
            str(refused.value)


def test_mla_and_per_head_caches_are_refused() -> None:
    sd, dd, _, _ = _pair()
    mla = Case("vllm_mla", "sglang_mla", dict(SRC_EXT), dict(SRC_EXT), 1, 1, 0, 1)
    srcs, dst = mla.caches()
    msd, _ = mla.describe(srcs, dst)
    with pytest.raises(KVLayoutError, match="MLA True vs False"):
        remote.plan(msd, dd, torch.arange(4), torch.arange(4))


@pytest.mark.parametrize("side", ["src", "dst"])
def test_a_description_claiming_more_than_its_leaves_is_refused(side: str) -> None:
    """Strides that do not fit the leaves (a corrupt handshake) never become descriptors that
    read or write outside the tensors."""
    sd, dd, _, _ = _pair()
    victim = sd[0] if side == "src" else dd
    bad = dataclasses.replace(victim, strides=tuple((a, 4 * v if a == "B" else v) for a, v in victim.strides))
    last = victim.extent("S") - 1
    with pytest.raises(KVLayoutError, match="outside the tensors of"):
        if side == "src":
            remote.plan(bad, dd, torch.tensor([last]), torch.tensor([0]), strategy="direct")
        else:
            remote.plan(sd, bad, torch.tensor([0]), torch.tensor([last]), strategy="direct")


def test_a_stamped_object_loads_only_into_a_cache_of_its_fingerprint() -> None:
    from kvgen.runtime import MemoryObj

    here = remote.describe(_nhd(2), "vllm_flash_attn_nhd", tp_rank=0, tp_size=1)
    obj = MemoryObj(torch.zeros(4))
    remote.check_stamp(obj, here)  # nothing recorded: nothing to refuse
    remote.stamp(obj, here)
    assert obj.metadata.fingerprint == here.fingerprint
    remote.check_stamp(obj, remote.describe(_nhd(2), "vllm_flash_attn_nhd", tp_rank=0, tp_size=1))
    other_tp = remote.describe(_nhd(2, heads=4), "vllm_flash_attn_nhd", tp_rank=1, tp_size=2)
    with pytest.raises(KVLayoutError, match=f"fingerprint {here.fingerprint}, this cache's is {other_tp.fingerprint}"):
        remote.check_stamp(obj, other_tp)
    with pytest.raises(KVLayoutError, match="cannot stamp a Tensor"):
        remote.stamp(torch.zeros(1), here)
