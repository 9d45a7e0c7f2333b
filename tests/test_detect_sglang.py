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


def test_a_pool_layout_kvgen_has_no_spec_for_is_refused_in_sglangs_words() -> None:
    with pytest.raises(KVLayoutError, match="kv_cache_layout 'page_major_layer_major'.*has no kvgen spec"):
        detect(hnd_pool(), engine="sglang", kv_layout="page_major_layer_major")


class MHATokenToKVPool:
    """A stand-in with what kvgen.from_sglang reads of SGLang's pool of that name (the real
    class is exercised in tests/test_engine_sglang.py, where SGLang imports)."""

    def __init__(self, layout: str, buffers: list[list[torch.Tensor]], dtype: torch.dtype = torch.float32,
                 page_size: int = PAGE):
        self.kv_cache_layout = layout
        self.k_buffer, self.v_buffer = buffers
        self.k_scale_buffer = None
        self.start_layer = 0
        self.store_dtype, self.page_size = dtype, page_size


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
    with pytest.raises(KVLayoutError, match="'vectorized_5d': its buffers are not 5-D tiles"):
        kvgen.from_sglang(MHATokenToKVPool("vectorized_5d", [[b.bfloat16() for b in side] for side in hnd_pool()]))
    with pytest.raises(KVLayoutError, match="kv_cache_layout 'page_major_layer_major'"):
        kvgen.from_sglang(MHATokenToKVPool("page_major_layer_major", hnd_pool()))


# -- kv_cache_layout "vectorized_5d": ROCm AITER's SHUFFLE tiles, a cache of two parts ----------------

#: (storage dtype, x = 16 // its itemsize, the spec): bf16 and fp16 tiles of 8; fp8, stored as uint8, of 16.
TILED = [(torch.bfloat16, 8, "sglang_mha_vectorized_5d"), (torch.float16, 8, "sglang_mha_vectorized_5d"),
         (torch.uint8, 16, "sglang_mha_vectorized_5d_fp8")]
TILE_PAGE, TILE_HEAD = 32, 48  # page_size and head_dim: whole tiles of 8 and of 16, three tiles of 16 wide


def tile_code(layer: int, kv: int, slot: int, h: int, c: int, dtype: torch.dtype) -> int:
    """The stored bit pattern of (layer, K or V, slot, head, content): a positive normal bf16 / fp16
    (bits 0x2000 + a code below 0x4000) or a nonzero byte (uint8); every c of a row, and a step of
    any other coordinate, gives another pattern."""
    mixed = 7 * c + 1031 * h + 97 * slot + 4099 * kv + 211 * layer
    return mixed % 255 + 1 if dtype == torch.uint8 else 0x2000 + mixed % 0x4000


def tiled_pool(dtype: torch.dtype, x: int, slots: list[int],
               codes: list[int] | None = None) -> list[list[torch.Tensor]]:
    """[K layers, V layers] as SGLang 0.5.23 allocates them under vectorized_5d (memory_pool.py
    _create_buffers_normal: K [blocks, H, head_dim // x, page, x], V [blocks, H, page // x, head_dim, x]),
    token i's values (those of slot codes[i], by default slots[i]) where SGLang's writer
    (shuffle_5d_cache.py reshape_and_cache_shuffle_5d) puts slot slots[i]'s: zero elsewhere."""
    bits = torch.int16 if dtype != torch.uint8 else torch.uint8
    k = [torch.zeros(PAGES, H, TILE_HEAD // x, TILE_PAGE, x, dtype=bits) for _ in range(L)]
    v = [torch.zeros(PAGES, H, TILE_PAGE // x, TILE_HEAD, x, dtype=bits) for _ in range(L)]
    for layer in range(L):
        for slot, coded in zip(slots, codes or slots, strict=True):
            block, n = divmod(slot, TILE_PAGE)
            for h in range(H):
                for c in range(TILE_HEAD):
                    k[layer][block, h, c // x, n, c % x] = tile_code(layer, 0, coded, h, c, dtype)
                    v[layer][block, h, n // x, c, n % x] = tile_code(layer, 1, coded, h, c, dtype)
    return [[b.view(dtype) for b in k], [b.view(dtype) for b in v]]


def tile_rows(dtype: torch.dtype, slots: list[int]) -> list[torch.Tensor]:
    """Per layer, K's then V's [T, H, C] rows of `slots` in token order, as a kv_planes object holds them."""
    bits = torch.int16 if dtype != torch.uint8 else torch.uint8
    return [torch.tensor([[[[tile_code(layer, kv, s, h, c, dtype) for c in range(TILE_HEAD)] for h in range(H)]
                           for s in slots] for kv in range(2)], dtype=bits).view(dtype) for layer in range(L)]


TILE_SLOTS = [1, 7, 8, 33, 47, 64, 90, 95]  # both sides of tile edges (8 and 16), three pages
TILE_AGAIN = [40, 2, 71, 16, 9, 31, 56, 80]


@pytest.mark.parametrize(("dtype", "x", "layout"), TILED, ids=lambda p: str(p).removeprefix("torch."))
def test_from_sglang_binds_a_vectorized_5d_pool_by_its_word_and_dtype(dtype: torch.dtype, x: int, layout: str) -> None:
    """The pool's word and storage dtype choose the spec; stored through the bound connector, each
    layer's object holds K's and then V's rows of the tokens in order (the layout the reference
    reads), and loaded at other slots into an empty pool, every byte is where SGLang's writer puts
    those tokens."""
    source = MHATokenToKVPool("vectorized_5d", tiled_pool(dtype, x, TILE_SLOTS), dtype, TILE_PAGE)
    bound = kvgen.from_sglang(source)
    assert (bound.layout, bound.obj, bound.layer_ids) == (layout, "kv_planes", tuple(range(L)))
    assert bound.kvcaches[0][0] is source.k_buffer[0]  # the pool's own buffers, no copy
    t = len(TILE_SLOTS)
    obj = MemoryObj(torch.zeros(tuple(bound.connector.get_shape(t)), dtype=torch.uint8))
    bound.connector.from_gpu(obj, 0, t, kvcaches=bound.kvcaches, slot_mapping=torch.tensor(TILE_SLOTS))
    for layer, rows in enumerate(tile_rows(dtype, TILE_SLOTS)):
        assert torch.equal(obj.tensor[layer].view(dtype).reshape(rows.shape), rows)
    empty = MHATokenToKVPool("vectorized_5d", tiled_pool(dtype, x, []), dtype, TILE_PAGE)
    back = kvgen.from_sglang(empty)
    back.connector.to_gpu(obj, 0, t, kvcaches=back.kvcaches, slot_mapping=torch.tensor(TILE_AGAIN))
    want = tiled_pool(dtype, x, TILE_AGAIN, TILE_SLOTS)
    for got, ref in zip((*empty.k_buffer, *empty.v_buffer), (*want[0], *want[1]), strict=True):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))  # every byte, moved and not


def test_a_vectorized_5d_pool_is_never_detected_from_its_tensors() -> None:
    """5-D tiles are no 4-D layout read otherwise, with or without another word; the word itself names
    what binds it (detection reads one tree of tensors, this cache has two parts)."""
    cache = tiled_pool(torch.bfloat16, 8, TILE_SLOTS)
    # head_dim 64 and page_size 64 (the page SGLang picks for vectorized_5d): K and V of one shape
    square = [[torch.zeros(PAGES, H, 8, 64, 8, dtype=torch.bfloat16) for _ in range(L)] for _ in "kv"]
    for hints in ({}, {"engine": "sglang"}, {"engine": "sglang", "kv_layout": "hnd"},
                  {"engine": "sglang", "kv_layout": "nhd"}):
        with pytest.raises(NoLayout):
            detect(square, **hints)
        with pytest.raises(KVLayoutError, match="every tensor must have one shape"):
            detect(cache, **hints)
    with pytest.raises(KVLayoutError, match=r"'vectorized_5d'.*two parts.*kvgen.from_sglang\(pool\) binds it"):
        detect(square, engine="sglang", kv_layout="vectorized_5d")


def test_from_sglang_refuses_a_vectorized_5d_pool_it_has_no_spec_for() -> None:
    """float32 (x 4: SGLang builds it, AITER's kernels read bf16, fp16 and fp8) and tiles of another x."""
    k, v = tiled_pool(torch.uint8, 16, [])
    four = [[torch.zeros(PAGES, H, TILE_HEAD // 4, TILE_PAGE, 4)] * L,
            [torch.zeros(PAGES, H, TILE_PAGE // 4, TILE_HEAD, 4)] * L]
    with pytest.raises(KVLayoutError, match="'vectorized_5d': its buffers are float32; kvgen's specs"):
        kvgen.from_sglang(MHATokenToKVPool("vectorized_5d", four, page_size=TILE_PAGE))
    sixteen = [[b.view(torch.bfloat16) for b in k], [b.view(torch.bfloat16) for b in v]]  # bf16 is x 8, not 16
    with pytest.raises(KVLayoutError, match="not tiles of x 8 and page_size 32"):
        kvgen.from_sglang(MHATokenToKVPool("vectorized_5d", sixteen, page_size=TILE_PAGE))
    with pytest.raises(KVLayoutError, match="not tiles of x 16 and page_size 64"):
        kvgen.from_sglang(MHATokenToKVPool("vectorized_5d", [k, v], page_size=64))


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed: the checks run")
def test_kvgen_verify_says_the_sglang_checks_were_skipped_and_why(capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgen.tools.verify import engines as verify_engines

    # SGLang's checks alone (vLLM's: tests/test_engine_vllm.py)
    monkeypatch.setattr(verify_engines, "ENGINES", {"SGLang": verify_engines.ENGINES["SGLang"]})
    assert verify_engines.run() == 0
    out = capsys.readouterr().out
    assert "SGLang 0.5.23 engine checks skipped: sglang is not installed in this Python" in out
    assert "scripts/dev engines" in out
