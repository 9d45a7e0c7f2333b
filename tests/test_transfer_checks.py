"""Every input of a transfer is checked before the first write, whole and layer by layer:
caches (each against its layout, then against each other: L, KV, C, dtype, shared memory),
slot tensors, head ranges and keywords. A refused call leaves both caches bit-for-bit as they
were; a layerwise transfer refuses at its first next(), before layer 0."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from harness import builtin_library

from kvgen import generated
from kvgen.oracle.reference import transfers
from kvgen.oracle.scenarios import clone_tree, same_bits
from kvgen.oracle.scenarios.transfers import DST_EXT, SRC_EXT, make_cache
from kvgen.runtime import KVLayoutError
from kvgen.tp import HeadRanges, Route

LIBRARY = builtin_library()
HND, NHD = LIBRARY["vllm_flash_attn_hnd"], LIBRARY["vllm_flash_attn_nhd"]
T = generated.transfer("vllm_flash_attn_hnd", "vllm_flash_attn_nhd")
SLOTS = torch.tensor([4, 5, 6, 7, 9, 10, 30])


def _caches(src_ext: dict[str, int] = SRC_EXT, dst_ext: dict[str, int] = DST_EXT) -> tuple[Any, Any]:
    return make_cache(HND, src_ext, torch.float32, "cpu"), make_cache(NHD, dst_ext, torch.float32, "cpu", 10000)


def _refused(call: Callable[[Any, Any], Any], src: Any, dst: Any, *words: str, layerwise: bool = False) -> str:
    """Run `call(transfer, layerwise)`; it must raise KVLayoutError saying `words` and write nothing."""
    before_src, before_dst = clone_tree(src), clone_tree(dst)
    transfer = T()
    with pytest.raises(KVLayoutError) as info:
        result = call(transfer, layerwise)
        if layerwise:
            next(result)  # the checks run at the first step
    message = str(info.value)
    for word in words:
        assert word in message, message
    assert same_bits(src, before_src) and same_bits(dst, before_dst), "a refused transfer wrote"
    return message


def _run(src: Any, s: Any, dst: Any, d: Any, **kw: Any) -> Callable[[Any, bool], Any]:
    def call(transfer: Any, layerwise: bool) -> Any:
        if layerwise:
            return transfer.copy_layers(src, s, dst, d, **kw)
        return transfer.copy(src, s, dst, d, **kw)
    return call


FORMS = pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])


@FORMS
def test_source_cache_of_another_layout(layerwise: bool) -> None:
    src, dst = _caches()
    wrong = make_cache(LIBRARY["vllm_kv_tuple"], SRC_EXT, torch.float32, "cpu")
    _refused(_run(wrong, SLOTS, dst, SLOTS), src, dst, "src_caches", "vllm_flash_attn_hnd", "L -> [KV=2 B H N C]",
             layerwise=layerwise)


@FORMS
def test_destination_that_is_no_cache(layerwise: bool) -> None:
    src, dst = _caches()
    _refused(_run(src, SLOTS, {"k": 1}, SLOTS), src, dst, "dst_caches", "vllm_flash_attn_nhd", layerwise=layerwise)


@FORMS
@pytest.mark.parametrize("axis,value", [("L", 3), ("C", 8)])
def test_caches_that_disagree_on_an_extent(axis: str, value: int, layerwise: bool) -> None:
    src, dst = _caches(dst_ext={**DST_EXT, axis: value})
    _refused(_run(src, SLOTS, dst, SLOTS), src, dst, f"agree on {axis}", f"{axis}={value}", layerwise=layerwise)


@FORMS
def test_caches_of_two_dtypes(layerwise: bool) -> None:
    src = make_cache(HND, SRC_EXT, torch.float32, "cpu")
    dst = make_cache(NHD, DST_EXT, torch.bfloat16, "cpu")
    _refused(_run(src, SLOTS, dst, SLOTS), src, dst, "float32", "bfloat16", layerwise=layerwise)


BAD_SLOTS = [
    ("float", lambda: (SLOTS.float(), SLOTS), "signed integers"),
    ("uint32 source", lambda: (SLOTS.to(torch.uint32), SLOTS), "src_slots must hold signed integers"),
    ("uint64 destination", lambda: (SLOTS, SLOTS.to(torch.uint64)), "dst_slots must hold signed integers"),
    ("2-D", lambda: (SLOTS[None], SLOTS), "1-D"),
    ("list", lambda: (SLOTS.tolist(), SLOTS), "1-D integer tensor"),
    ("lengths differ", lambda: (SLOTS, SLOTS[:-1]), "7 and 6 slots"),
    ("source slot outside", lambda: (torch.tensor([0, 48]), torch.tensor([0, 1])), "src_slots: slot 48"),
    ("destination slot outside", lambda: (torch.tensor([0, 1]), torch.tensor([2, 40])), "dst_slots: slot 40"),
    ("destination slot twice", lambda: (torch.tensor([0, 1, 2]), torch.tensor([5, 6, 5])), "slot 5 is written"),
]


@FORMS
@pytest.mark.parametrize("name,make,word", BAD_SLOTS, ids=[b[0] for b in BAD_SLOTS])
def test_bad_slots(name: str, make: Callable[[], tuple[Any, Any]], word: str, layerwise: bool) -> None:
    src, dst = _caches()
    s, d = make()
    message = _refused(_run(src, s, dst, d), src, dst, word, layerwise=layerwise)
    if name == "destination slot twice":
        assert "tokens [0, 2]" in message


def test_a_repeated_destination_slot_whose_source_is_skipped_moves_once() -> None:
    src, dst = _caches()
    want = clone_tree(dst)
    s, d = [0, -1, 2], [5, 5, 7]
    T().copy(src, torch.tensor(s), dst, torch.tensor(d))
    transfers.transfer(transfers.TransferSide(HND, SRC_EXT, src, s),
        transfers.TransferSide(NHD, DST_EXT, want, d))
    assert same_bits(dst, want)


BAD_HEADS = [
    (HeadRanges(src_heads=(0, 1, 2)), "src_heads must be a (start, stop) pair"),  # type: ignore[arg-type]
    (HeadRanges(src_heads="01"), "(start, stop) pair"),  # type: ignore[arg-type]
    (HeadRanges(src_heads=(True, 2)), "(start, stop) pair"),
    (HeadRanges(src_heads=(0, 3)), "has 2 heads"),
    (HeadRanges(dst_heads=(1, 1)), "dst_heads (1, 1) is not a non-empty range"),
    (HeadRanges(src_heads=(0, 1)), "1 heads but dst_heads (0, 2) is 2"),
    (HeadRanges(src_heads=(0, 1), dst_heads=(0, 2)), "src_heads (0, 1) is 1 heads"),
    # the two ranges travel as one object: a pair of pairs, or a route itself, is not one
    (((0, 1), (0, 1)), "heads must be a kvgen.tp.HeadRanges"),
    (Route(0, 0, (0, 1), (0, 1)), "a kvgen.tp.Route's .heads"),
]


@FORMS
@pytest.mark.parametrize("heads,word", BAD_HEADS, ids=[str(h[0]) for h in BAD_HEADS])
def test_bad_head_ranges(heads: Any, word: str, layerwise: bool) -> None:
    src, dst = _caches()
    _refused(_run(src, SLOTS, dst, SLOTS, heads=heads), src, dst, word, layerwise=layerwise)


@FORMS
def test_head_ranges_move_source_head_onto_destination_head(layerwise: bool) -> None:
    # source head 1 of 2 into destination head 0 of 1: head 0 of the destination holds what head 1 of the source held
    src, dst = _caches(dst_ext={**DST_EXT, "H": 1})
    want = clone_tree(dst)
    transfers.transfer(transfers.TransferSide(HND, SRC_EXT, src, SLOTS.tolist(), (1, 2)),
        transfers.TransferSide(NHD, {**DST_EXT, "H": 1}, want, SLOTS.tolist(), (0, 1)))
    out = _run(src, SLOTS, dst, SLOTS, heads=HeadRanges((1, 2), (0, 1)))(T(), layerwise)
    if layerwise:
        assert sum(1 for _ in out) == SRC_EXT["L"] + 1
    assert same_bits(dst, want)
    assert torch.equal(dst[1][1, 1, 1, 0], src[1][1, 1, 1, 1])  # layer 1, V, slot 5 (block 1, offset 1), head 1 -> 0


def test_a_layout_without_heads_takes_only_the_whole_latent() -> None:
    mla, host = LIBRARY["vllm_mla"], LIBRARY["hicache_mla_page_first"]
    src, dst = make_cache(mla, SRC_EXT, torch.float32, "cpu"), make_cache(host, DST_EXT, torch.float32, "cpu", 10000)
    t = generated.transfer(mla.name, host.name)()
    with pytest.raises(KVLayoutError, match="no head axis"):
        t.copy(src, SLOTS, dst, SLOTS, heads=HeadRanges((0, 2), (0, 2)))
    want = clone_tree(dst)
    t.copy(src, SLOTS, dst, SLOTS, heads=HeadRanges((0, 1), (0, 1)))
    transfers.transfer(transfers.TransferSide(mla, SRC_EXT, src, SLOTS.tolist()),
        transfers.TransferSide(host, DST_EXT, want, SLOTS.tolist()))
    assert same_bits(dst, want)


@FORMS
def test_one_cache_as_source_and_destination(layerwise: bool) -> None:
    same = generated.transfer("vllm_flash_attn_nhd", "vllm_flash_attn_nhd")
    cache = make_cache(NHD, SRC_EXT, torch.float32, "cpu")
    before = clone_tree(cache)
    with pytest.raises(KVLayoutError, match=r"dst_caches\[0\] shares memory with src_caches\[0\]"):
        t = same()
        out = t.copy_layers(cache, SLOTS, cache, SLOTS + 8) if layerwise else t.copy(cache, SLOTS, cache, SLOTS + 8)
        if layerwise:
            next(out)
    assert same_bits(cache, before)


@FORMS
def test_destination_leaf_that_views_a_source_leaf(layerwise: bool) -> None:
    src, dst = _caches(dst_ext=SRC_EXT)
    # the destination's layer 1 is the source's layer 0 seen in NHD order
    dst[1] = src[0].permute(0, 1, 3, 2, 4)
    _refused(_run(src, SLOTS, dst, SLOTS), src, dst, "dst_caches[1] shares memory with src_caches[0]",
             layerwise=layerwise)


def test_caches_in_two_halves_of_one_buffer_are_fine() -> None:
    shape = (2, SRC_EXT["B"], SRC_EXT["H"], SRC_EXT["N"], SRC_EXT["C"])
    pool = torch.zeros((4, *shape))
    src, dst = [pool[0], pool[1]], [pool[2].view(2, 12, 4, 2, 4), pool[3].view(2, 12, 4, 2, 4)]
    for i, t in enumerate(src):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + 1000 * i)
    T().copy(src, SLOTS, dst, SLOTS)
    assert torch.equal(dst[1][1, 1, 1, 0], src[1][1, 1, 0, 1])  # slot 5, head 0, value 0 of V


@pytest.mark.parametrize("method,keyword,hint", [("copy", "haeds", "heads"), ("copy_layers", "snyc", "sync"),
                                                 ("copy_layers", "haeds", "heads")])
def test_unknown_keyword_names_a_close_match(method: str, keyword: str, hint: str) -> None:
    src, dst = _caches()
    before = clone_tree(dst)
    with pytest.raises(TypeError, match=f"{method}\\(\\) got an unexpected keyword argument '{keyword}' "
                                        f"\\(did you mean '{hint}'\\?\\)"):
        getattr(T(), method)(src, SLOTS, dst, SLOTS, **{keyword: 1})
    assert same_bits(dst, before)


@pytest.mark.parametrize("method", ["copy", "copy_layers"])
@pytest.mark.parametrize("keyword", ["src_heads", "dst_heads"])
def test_separate_head_keywords_are_refused_with_the_one_argument_they_became(method: str, keyword: str) -> None:
    src, dst = _caches()
    before = clone_tree(dst)
    with pytest.raises(TypeError, match=r"heads=kvgen\.tp\.HeadRanges\(src_heads=\(start, stop\), "
                                        r"dst_heads=\(start, stop\)\)"):
        getattr(T(), method)(src, SLOTS, dst, SLOTS, **{keyword: (0, 1)})
    assert same_bits(dst, before)


def test_copy_and_copy_layers_show_their_keywords() -> None:
    # the keyword check wraps them, and their signatures stay what help() and editors show
    assert [*inspect.signature(T.copy).parameters][-1:] == ["heads"]
    assert [*inspect.signature(T.copy_layers).parameters][-2:] == ["heads", "sync"]


def test_asking_for_a_pair_that_was_not_generated_says_how_to_add_it() -> None:
    with pytest.raises(KVLayoutError, match="'vllm_rbln -> vllm_lbnhc', in a transfers.yaml"):
        generated.transfer("RBLN", "LBNHC")
    with pytest.raises(KVLayoutError, match="no layout or object named 'nope'"):
        generated.transfer("nope", "NHD")


def test_one_transfer_shared_by_four_threads() -> None:
    t = T()
    errors: list[BaseException] = []
    results: list[bool] = []

    def work(seed: int) -> None:
        try:
            for i in range(5):
                gen = torch.Generator().manual_seed(seed * 10 + i)
                s = torch.randperm(48, generator=gen)[:16]
                d = torch.randperm(40, generator=gen)[:16]
                src, dst = _caches()
                want = clone_tree(dst)
                if i % 2:
                    for _ in t.copy_layers(src, s, dst, d):
                        pass
                else:
                    t.copy(src, s, dst, d)
                transfers.transfer(transfers.TransferSide(HND, SRC_EXT, src, s.tolist()),
                    transfers.TransferSide(NHD, DST_EXT, want, d.tolist()))
                results.append(same_bits(dst, want))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and results == [True] * 20


def test_slots_on_another_device_are_refused() -> None:
    src, dst = _caches()
    _refused(_run(src, SLOTS.to("meta"), dst, SLOTS), src, dst, "must be on the cpu or on cpu (its cache's device)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("where", ["gpu to host", "host to gpu"])
def test_between_a_gpu_cache_and_a_host_pool(where: str) -> None:
    nhd, host = LIBRARY["vllm_flash_attn_nhd"], LIBRARY["hicache_page_first"]
    to_host = where == "gpu to host"
    pair, (src_dev, dst_dev) = ((nhd, host), ("cuda", "cpu")) if to_host else ((host, nhd), ("cpu", "cuda"))
    src = make_cache(pair[0], SRC_EXT, torch.float32, src_dev)
    dst = make_cache(pair[1], DST_EXT, torch.float32, dst_dev, 10000)
    want = [t.cpu() for t in dst] if isinstance(dst, list) else dst.cpu()
    s, d = [4, 5, 6, 7, 9, -1, 30, 31], [1, 2, 3, 8, 9, 10, -1, 39]
    t = generated.transfer(pair[0].name, pair[1].name)()
    t.copy(src, torch.tensor(s), dst, torch.tensor(d, device=dst_dev))
    host_src = [x.cpu() for x in src] if isinstance(src, list) else src.cpu()
    transfers.transfer(transfers.TransferSide(pair[0], SRC_EXT, host_src, s),
        transfers.TransferSide(pair[1], DST_EXT, want, d))
    got = [x.cpu() for x in dst] if isinstance(dst, list) else dst.cpu()
    assert same_bits(got, want)


@FORMS
@pytest.mark.parametrize("side", ["src", "dst"])
def test_a_cache_tensor_with_shrunk_storage_is_refused(side: str, layerwise: bool) -> None:
    """Layer 1's storage shrunk (an engine's sleep mode frees it): refused before any write."""
    src, dst = _caches()
    T().copy(src, SLOTS, dst, SLOTS)  # both bound
    (src if side == "src" else dst)[1].untyped_storage().resize_(16)
    others = [src[0], dst[0]]
    before = clone_tree(others)
    transfer = T()
    with pytest.raises(KVLayoutError, match=rf"{side}_caches\[1\]: its storage holds 16 bytes"):
        result = _run(src, SLOTS, dst, SLOTS)(transfer, layerwise)
        if layerwise:
            next(result)
    assert same_bits(others, before)


@pytest.mark.parametrize("side", ["src", "dst"])
def test_a_layer_freed_between_two_steps_of_copy_layers_stops_it(side: str) -> None:
    """Layer 0 is copied, then one side's layer 1 (the last) is freed: the next step is
    refused, and the destination's layer 1 (where it is not the one freed) keeps its bits."""
    src, dst = _caches()
    gen = T().copy_layers(src, SLOTS, dst, SLOTS)
    next(gen)
    (src if side == "src" else dst)[1].untyped_storage().resize_(16)
    kept = [] if side == "dst" else [dst[1]]
    before = clone_tree(kept)
    with pytest.raises(KVLayoutError, match=rf"layer 1: cache tensor {side}_caches\[1\]: its storage holds 16 bytes"):
        next(gen)
    assert same_bits(kept, before)
