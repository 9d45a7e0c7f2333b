"""SGLang's pools say their layout (`kv_cache_layout`: "nhd", "hnd"); detection takes that word as
the deciding fact and never reads a 4-D SGLang buffer's order from its shape. The buffers here are
built as SGLang 0.5.23's MHATokenToKVPool builds them (memory_pool.py `_create_buffers_normal`:
per layer one fused [2, rows or pages, ...] tensor, K = buf[0], V = buf[1]), without importing
SGLang; tests/test_engine_sglang.py repeats the checks on SGLang's own pool classes.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import kvgen
from kvgen import generated
from kvgen.integrations.detect import AmbiguousLayout, NoLayout, detect
from kvgen.runtime import KVLayoutError, MemoryObj

L, H, PAGE, C, PAGES = 2, 4, 16, 8, 3  # H != PAGE: a swapped reading changes the extents


def code(layer: int, kv: int, slot: int, h: int, c: int) -> float:
    """The value at (layer, K or V, slot, head, content): every coordinate is recoverable."""
    return float((((layer * 2 + kv) * PAGES * PAGE + slot) * H + h) * C + c)


def hnd_pool() -> list[list[torch.Tensor]]:
    """[K layers, V layers] of [pages, H, page_size, C], views of one fused buffer per layer."""
    fused = []
    for layer in range(L):
        buf = torch.empty(2, PAGES, H, PAGE, C)
        for kv in range(2):
            for slot in range(PAGES * PAGE):
                for h in range(H):
                    buf[kv, slot // PAGE, h, slot % PAGE] = torch.tensor(
                        [code(layer, kv, slot, h, c) for c in range(C)])
        fused.append(buf)
    return [[b[0] for b in fused], [b[1] for b in fused]]


def nhd_pool() -> list[list[torch.Tensor]]:
    """[K layers, V layers] of [rows, H, C] (rows = pages * page_size), halves of one buffer."""
    fused = []
    for layer in range(L):
        buf = torch.empty(2, PAGES * PAGE, H, C)
        for kv in range(2):
            for slot in range(PAGES * PAGE):
                for h in range(H):
                    buf[kv, slot, h] = torch.tensor([code(layer, kv, slot, h, c) for c in range(C)])
        fused.append(buf)
    return [[b[0] for b in fused], [b[1] for b in fused]]


def stored(layout: str, cache: list[list[torch.Tensor]], slots: torch.Tensor) -> torch.Tensor:
    conn = generated.get(layout, "kv_2ltd")()
    obj = MemoryObj(torch.full(tuple(conn.get_shape(len(slots), cache)), -1.0))
    conn.from_gpu(obj, 0, len(slots), kvcaches=cache, slot_mapping=slots)
    return obj.tensor


def expected(slots: torch.Tensor) -> torch.Tensor:
    out = torch.empty(2, L, len(slots), H * C)
    for kv in range(2):
        for layer in range(L):
            for t, slot in enumerate(slots.tolist()):
                out[kv, layer, t] = torch.tensor([code(layer, kv, slot, h, c) for h in range(H) for c in range(C)])
    return out


SLOTS = torch.tensor([17, 3, 40, 16, 31, 0, 47])


def test_an_hnd_pool_without_its_layout_word_is_refused_naming_the_hint() -> None:
    with pytest.raises(AmbiguousLayout) as err:
        detect(hnd_pool(), engine="sglang")
    assert {"sglang_mha_hnd", "sglang_mha_blocks"} <= set(err.value.candidates)
    assert "kv_layout" in str(err.value) and "kv_cache_layout" in str(err.value)
    assert err.value.candidates["sglang_mha_hnd"]["kv_layout"] == "hnd"


def test_head_and_page_counts_do_not_replace_the_pools_layout_word() -> None:
    for pool in (hnd_pool(), [[t.reshape(PAGES, PAGE, H, C) for t in kvs] for kvs in nhd_pool()]):
        with pytest.raises(AmbiguousLayout, match="kv_cache_layout"):
            detect(pool, engine="sglang", num_kv_heads=H, block_size=PAGE)


@pytest.mark.parametrize("word", ["hnd", "HND", "Hnd"])
def test_an_hnd_pool_named_by_its_layout_moves_the_right_elements(word: str) -> None:
    pool = hnd_pool()
    found = detect(pool, engine="sglang", kv_layout=word)
    assert found.layout == "sglang_mha_hnd"
    assert (found.extents["H"], found.extents["N"], found.extents["B"]) == (H, PAGE, PAGES)
    assert torch.equal(stored(found.layout, pool, SLOTS), expected(SLOTS))


@pytest.mark.parametrize("word", ["nhd", "NHD"])
def test_the_default_nhd_pool_named_by_its_layout_is_found(word: str) -> None:
    pool = nhd_pool()
    found = detect(pool, engine="sglang", kv_layout=word)
    assert found.layout == "sglang_mha"
    assert torch.equal(stored(found.layout, pool, SLOTS), expected(SLOTS))


def test_the_layout_word_must_agree_with_the_buffers() -> None:
    with pytest.raises(NoLayout):
        detect(nhd_pool(), engine="sglang", kv_layout="hnd")  # 3-D buffers are no HND pool


@pytest.mark.parametrize("word", ["vectorized_5d", "page_major_layer_major"])
def test_a_pool_layout_kvgen_has_no_spec_for_is_refused_in_sglangs_words(word: str) -> None:
    with pytest.raises(KVLayoutError, match=f"kv_cache_layout {word!r}"):
        detect(hnd_pool(), engine="sglang", kv_layout=word)


class MHATokenToKVPool:
    """A stand-in with what kvgen.from_sglang reads of SGLang's pool of that name (the real
    class is exercised in tests/test_engine_sglang.py, where SGLang imports)."""

    def __init__(self, layout: str, buffers: list[list[torch.Tensor]]):
        self.kv_cache_layout = layout
        self.k_buffer, self.v_buffer = buffers
        self.k_scale_buffer = None
        self.start_layer = 0


@pytest.mark.parametrize(("word", "make", "layout"),
                         [("hnd", hnd_pool, "sglang_mha_hnd"), ("nhd", nhd_pool, "sglang_mha")])
def test_from_sglang_takes_the_layout_from_the_pool(word: str, make: object, layout: str) -> None:
    bound = kvgen.from_sglang(MHATokenToKVPool(word, make()))  # type: ignore[operator]
    assert (bound.layout, bound.obj, bound.layer_ids) == (layout, "kv_2ltd", tuple(range(L)))
    obj = MemoryObj(torch.full(tuple(bound.connector.get_shape(len(SLOTS))), -1.0))
    bound.connector.from_gpu(obj, 0, len(SLOTS), kvcaches=bound.kvcaches, slot_mapping=SLOTS)
    assert torch.equal(obj.tensor, expected(SLOTS))


def test_from_sglang_refuses_a_pool_whose_word_disagrees_with_its_buffers() -> None:
    with pytest.raises(KVLayoutError, match="MHATokenToKVPool with kv_cache_layout 'nhd'"):
        kvgen.from_sglang(MHATokenToKVPool("nhd", hnd_pool()))
    with pytest.raises(KVLayoutError, match="kv_cache_layout 'vectorized_5d'.*ROCm AITER"):
        kvgen.from_sglang(MHATokenToKVPool("vectorized_5d", hnd_pool()))


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed: the checks run")
def test_kvgen_verify_says_the_sglang_checks_were_skipped_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    from kvgen.tools.verify import engines as verify_engines

    assert verify_engines.run() == 0
    out = capsys.readouterr().out
    assert "SGLang 0.5.23 engine checks skipped: sglang is not installed in this Python" in out
    assert "scripts/dev engines" in out
