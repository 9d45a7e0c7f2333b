"""Every built-in layout-to-layout transfer against the element-by-element reference
(kvgen.oracle.reference.transfers), with coordinate-coded caches: partial blocks, -1 slots on
either side, block sizes that differ, head ranges, strided and odd-offset caches; every
scenario, whole and layer by layer, on one transfer of each structure; dtypes. Each runs on
the compiled CPU kernel and on the generated torch copies (the copy_backend fixture); a
CUDA device runs the torch copies only."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import builtin_library

from kvgen import generated, tp
from kvgen.oracle.scenarios.transfers import (
    SCENARIOS,
    SRC_EXT,
    TransferRun,
    applies,
    check_transfer,
    make_cache,
    run_transfer,
)
from kvgen.spec.model import Spec
from kvgen.spec.transfers import load_transfers

LIBRARY = builtin_library()
BUILTIN = load_transfers(LIBRARY)
MODULES = {p.module: (p.src, p.dst) for p in BUILTIN}

#: What the issue asks of every transfer: partial blocks, -1 on either side, other block
#: sizes, head ranges (layouts with heads).
CORE = ("partial_minus1", "larger_dst_blocks", "heads_shifted")
#: One transfer per structure: block <-> block (B and N apart), lists <-> a folded slot axis,
#: one tensor with heads outermost <-> (K, V) tuples, MLA with a singleton dim, the same layout.
REPRESENTATIVE = (
    "xfer__vllm_flash_attn_hnd__vllm_flash_attn_nhd",
    "xfer__sglang_mha__vllm_flash_attn_nhd",
    "xfer__vllm_flash_attn_nhd__hicache_page_first",
    "xfer__dynamo_universal__vllm_kv_tuple",
    "xfer__hicache_layer_first__vllm_flashinfer_nhd",
    "xfer__vllm_mla__hicache_mla_page_first_direct",
    "xfer__vllm_flash_attn_nhd__vllm_flash_attn_nhd",
)
#: Layer by layer, every scenario on these (each module's per-layer copy runs once below).
LAYERWISE = REPRESENTATIVE[:3]


def test_the_generated_package_holds_every_declared_transfer() -> None:
    assert set(generated.TRANSFERS) == {(p.src.name, p.dst.name) for p in BUILTIN}
    assert set(REPRESENTATIVE) <= set(MODULES)


def test_the_builtin_set_covers_the_issue() -> None:
    pairs = set(generated.TRANSFERS)
    both = lambda a, b: {(a, b), (b, a)} <= pairs  # noqa: E731
    assert both("vllm_flash_attn_hnd", "vllm_flash_attn_nhd")
    assert both("vllm_flashinfer_nhd", "vllm_flash_attn_nhd")
    assert both("sglang_mha", "vllm_flash_attn_nhd") and both("sglang_mla", "vllm_mla")
    engines = ("vllm_flash_attn_nhd", "vllm_flash_attn_hnd", "vllm_flashinfer_nhd", "vllm_kv_tuple", "sglang_mha")
    hosts = ("hicache_layer_first", "hicache_page_first", "hicache_page_first_direct",
             "vllm_offload_nhd", "dynamo_universal")
    assert all(both(e, h) for e in engines for h in hosts)
    mla_hosts = ("hicache_mla_layer_first", "hicache_mla_page_first", "hicache_mla_page_first_direct",
                 "vllm_offload_mla")
    assert all(both(e, h) for e in ("vllm_mla", "sglang_mla") for h in mla_hosts)
    assert all(both(e, "hicache_page_unified") for e in ("sglang_mha", "sglang_mha_hnd"))  # SGLang 0.5.23's own
    assert all(both(e, "hicache_page_unified_per_head") for e in ("sglang_mha", "sglang_mha_hnd"))
    assert all(both(e, "hicache_page_unified_grouped") for e in ("sglang_mha", "sglang_mha_hnd"))
    assert all(both(e, "hicache_mla_page_unified") for e in ("vllm_mla", "sglang_mla"))


def test_the_entry_point_of_the_issue() -> None:
    T = generated.transfer("vllm_flash_attn_hnd", "vllm_flash_attn_nhd")
    src, dst = LIBRARY["vllm_flash_attn_hnd"], LIBRARY["vllm_flash_attn_nhd"]
    ext = {**SRC_EXT, "H": 8}
    a, b = make_cache(src, ext, torch.float32, "cpu"), make_cache(dst, ext, torch.float32, "cpu", 10000)
    slots = torch.arange(8, 24)
    T().copy(a, slots, b, slots, heads=tp.HeadRanges((0, 8), (0, 8)))
    # layer 1, V, slot 9 (block 2, offset 1), head 5: HND holds it at [1, 2, 5, 1], NHD at [1, 2, 1, 5]
    assert torch.equal(b[1][1, 2, 1, 5], a[1][1, 2, 5, 1])
    assert generated.transfer("HND", "nhd") is T  # aliases, any case


def _transfer(src: Spec, dst: Spec, device: str, copy_backend: str) -> Any:
    """A transfer object on `copy_backend`; the compiled kernel moves CPU caches only."""
    if copy_backend == "native" and device != "cpu":
        pytest.skip("the compiled kernel moves CPU caches only")
    return generated.transfer(src.name, dst.name)(copy_backend=copy_backend)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_builtin_transfer_matches_reference(module: str, device: str, copy_backend: str) -> None:
    src, dst = MODULES[module]
    transfer = _transfer(src, dst, device, copy_backend)  # one object meets every cache in turn
    failed = [name for name in CORE if applies(src, dst, SCENARIOS[name])
              and not check_transfer(generated, src, dst, device, SCENARIOS[name], TransferRun(transfer=transfer))]
    assert failed == [], f"{module} differs from the reference in {failed}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_builtin_transfer_layer_by_layer(module: str, device: str, copy_backend: str) -> None:
    src, dst = MODULES[module]
    transfer = _transfer(src, dst, device, copy_backend)
    assert check_transfer(generated, src, dst, device, SCENARIOS["misaligned"],
                          TransferRun(transfer=transfer, layerwise=True))


@pytest.mark.parametrize("module,layerwise", [(m, False) for m in REPRESENTATIVE] + [(m, True) for m in LAYERWISE])
def test_every_scenario(module: str, layerwise: bool, device: str, copy_backend: str) -> None:
    src, dst = MODULES[module]
    transfer = _transfer(src, dst, device, copy_backend)
    failed = [sc.name for sc in SCENARIOS.values() if applies(src, dst, sc)
              and not check_transfer(generated, src, dst, device, sc,
                                     TransferRun(transfer=transfer, layerwise=layerwise))]
    assert failed == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("module", REPRESENTATIVE[:3])
def test_dtypes(module: str, dtype: torch.dtype, device: str, copy_backend: str) -> None:
    src, dst = MODULES[module]
    transfer = _transfer(src, dst, device, copy_backend)
    for name in ("partial_ends", "strided_src_odd_dst", "odd_src_strided_dst"):
        assert check_transfer(generated, src, dst, device, SCENARIOS[name], TransferRun(dtype, transfer))


def test_layerwise_yields_once_per_layer_then_once_more() -> None:
    src, dst = MODULES["xfer__vllm_flash_attn_hnd__vllm_flash_attn_nhd"]
    a = make_cache(src, SRC_EXT, torch.float32, "cpu")
    b = make_cache(dst, SRC_EXT, torch.float32, "cpu", 10000)
    t = generated.transfer(src.name, dst.name)()
    slots = torch.arange(16)
    assert run_transfer(t, (a, slots), (b, slots), layerwise=True) == SRC_EXT["L"] + 1
    # Each step has moved exactly its layer when it yields.
    fresh = make_cache(dst, SRC_EXT, torch.float32, "cpu", 10000)
    gen = t.copy_layers(a, slots, fresh, slots)
    for layer in range(SRC_EXT["L"]):
        next(gen)
        assert torch.equal(fresh[layer], b[layer])
        if layer + 1 < SRC_EXT["L"]:
            assert not torch.equal(fresh[layer + 1], b[layer + 1])
    next(gen)
    with pytest.raises(StopIteration):
        next(gen)


def test_a_block_path_and_a_token_path_share_a_call() -> None:
    """Whole blocks go by block ids, the partial ends by slot; both in one call."""
    from kvgen.runtime.transfer.pairs import pair_slots

    src, dst = MODULES["xfer__vllm_flash_attn_hnd__vllm_flash_attn_nhd"]
    t = generated.transfer(src.name, dst.name)()
    a = make_cache(src, SRC_EXT, torch.float32, "cpu")
    b = make_cache(dst, SRC_EXT, torch.float32, "cpu")
    gs, gd = t.check(a, b)
    s = torch.tensor([1, 2, 3, 20, 21, 22, 23, 8, 9, 10, 11, 40])
    d = torch.tensor([5, 6, 7, 12, 13, 14, 15, 28, 29, 30, 31, 3])
    p = pair_slots(s, d, gs, gd, (0, 0, 2))
    assert p.has_blocks and p.has_tokens and p.moved == 12
    assert torch.equal(torch.as_tensor(p.src_blocks), torch.tensor([5, 2]))  # sorted by destination block
    assert torch.equal(torch.as_tensor(p.dst_blocks), torch.tensor([3, 7]))
    assert sorted(p.dst_off.tolist()) == [1, 2, 3, 3]


def test_a_folded_side_moves_whole_blocks_of_the_other_sides_size() -> None:
    """A folded slot axis splits into blocks of the other side's size when that divides its
    slots (SGLang's host pools hold whole pages); otherwise every token goes by slot."""
    import dataclasses

    from kvgen.runtime.transfer.pairs import pair_slots

    src, dst = MODULES["xfer__hicache_page_first__vllm_flash_attn_nhd"]
    t = generated.transfer(src.name, dst.name)()
    gs, gd = t.check(make_cache(src, SRC_EXT, torch.float32, "cpu"), make_cache(dst, SRC_EXT, torch.float32, "cpu"))
    assert gs.N is None and gd.N == 4
    s, d = torch.arange(8, 16), torch.tensor([4, 5, 6, 7, 40, 41, 42, 43])
    p = pair_slots(s, d, gs, gd, (0, 0, 2))
    assert p.has_blocks and not p.has_tokens and p.block == 4
    assert p.src_blocks == slice(2, 4) and torch.equal(torch.as_tensor(p.dst_blocks), torch.tensor([1, 10]))
    odd = dataclasses.replace(gs, S=50)  # not whole pages of 4
    p = pair_slots(s, d, odd, gd, (0, 0, 2))
    assert not p.has_blocks and p.has_tokens
