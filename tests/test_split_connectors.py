"""Connectors for caches with split (tiled) axes (spec format 3: `C/8` with `C%8`, `N/8` with `N%8`),
against the byte-level reference, which places every value from the spec's own address arithmetic
(kvgen.oracle.address): the built-in specs of SGLang's vectorized_5d pools (AITER's SHUFFLE layout,
tiles of 8 and of 16), of MHATokenToKVPoolMXFP8's page-128 interleaved scales, and of HiCache's
page_unified host pool in head groups (H split by a factor read from the tensor), whose addresses
tests/test_engine_sglang_vectorized_5d.py, test_engine_sglang_mxfp8.py and test_engine_sglang.py check
against SGLang's kernels and pools.

Every byte of a cache carries a code of its part, tensor and position, so a value moved from a
transposed tile, or a token placed at another offset in its block, changes bytes the comparison sees:
the tampering tests show it does.
"""

from __future__ import annotations

import types
from dataclasses import replace
from typing import Any

import pytest
import torch
from harness import SCENARIOS, Scenario, block_table_mapping, make_cache, tiled_connector, tiled_plans

from kvgen.emit.render import MODULE_KINDS
from kvgen.oracle.scenarios import (
    check_pair,
    clone_tree,
    connector_load,
    connector_store,
    fitted,
    make_objects,
    obj_tensors,
    same_bits,
)
from kvgen.plan.kernel import PlanesKernelPlan, kernel_grid, make_planes_kernel_plan, plan_refusal
from kvgen.plan.planes import PlanesPlan
from kvgen.plan.program import program_plan
from kvgen.runtime import KVLayoutError, kernels, native
from kvgen.runtime.movers import native as native_mover
from kvgen.runtime.movers.base import Unsupported
from kvgen.runtime.movers.triton import TritonMover

NAMES = ("sglang_mha_vectorized_5d", "sglang_mha_vectorized_5d_fp8", "sglang_mha_mxfp8_interleaved",
         "hicache_page_unified_grouped")
PLANS = {p.module: p for p in tiled_plans().values() if isinstance(p, PlanesPlan) and p.paged.name in NAMES}


def connector_class(module: str, edit: tuple[str, str] | None = None) -> Any:
    plan = PLANS[module]
    return tiled_connector(plan.paged.name, plan.obj.name, edit)


def test_each_tiled_spec_pairs_with_both_planes_objects() -> None:
    assert sorted(PLANS) == sorted(f"{n}__{o}" for n in NAMES for o in ("kv_planes", "kv_planes_layer"))


@pytest.mark.parametrize("backend", [None, "torch", "native"])
@pytest.mark.parametrize("module", sorted(PLANS))
def test_every_scenario_matches_the_reference(module: str, backend: str | None) -> None:
    """All 16 slot scenarios (-1 at every place, partial and whole blocks, strided caches, odd
    storage offsets) through one connector, store and load, by default, on torch and on the compiled kernel."""
    plan = PLANS[module]
    connector = connector_class(module)(device="cpu", backend=backend)
    results = {name: check_pair(connector, plan.paged, plan.obj, sc) for name, sc in SCENARIOS.items()}
    assert all(ok == (True, True) for ok in results.values()), results


#: K 64 values wide: 8 tiles of 8, so a tile transposed with its places has the same shape.
SQUARE = replace(SCENARIOS["random_slots"], name="square_tiles", ext={**SCENARIOS["random_slots"].ext, "C.k": 64})
#: Blocks of 64 tokens: V's 8 tiles of 8, so its token tile and place swapped stay in bounds.
SQUARE_N = replace(SCENARIOS["random_slots"], name="square_pages", ext={**SCENARIOS["random_slots"].ext, "N": 64})
#: Two whole blocks of 64 tokens (V's block path, N / 8 = 8 = N % 8).
SQUARE_BLOCKS = Scenario("square_blocks", (0,), (128,), lambda r, e: block_table_mapping(128, r, e), ext=SQUARE_N.ext)
MORE = {**SCENARIOS, **{s.name: s for s in (SQUARE, SQUARE_N, SQUARE_BLOCKS)}}


@pytest.mark.parametrize("module, edit, scenario", [
    # K's tile and place swapped: value c of the object read from the cache's c % 8 * 8 + c // 8
    ("sglang_mha_vectorized_5d__kv_planes",
     (".unflatten(3, ((g.planes[0].values // 8), 8, (g.planes[0].C // g.planes[0].values // wd[0])))",
      ".unflatten(3, ((g.planes[0].values // 8), 8, (g.planes[0].C // g.planes[0].values // wd[0]))).transpose(3, 4)"),
     "square_tiles"),
    # V's token offset split the other way round: n % 8 taken as the tile, n // 8 as the place
    ("sglang_mha_vectorized_5d__kv_planes_layer", ("(ck.off // 8), :, (ck.off % 8)", "(ck.off % 8), :, (ck.off // 8)"),
     "square_pages"),
    # whole blocks of V: token n of a block taken as tile n % 8, place n // 8
    ("sglang_mha_vectorized_5d__kv_planes", ("(-1, g.N // 8, 8))", "(-1, g.N // 8, 8)).transpose(2, 3)"),
     "square_blocks"),
    # SGLang's head groups (H split by a factor read from the tensor, two groups of two heads here):
    # head h taken from group h % g at place h // g
    ("hicache_page_unified_grouped__kv_planes",
     (".unflatten(3, ((g.H // g.split('H%g')), g.split('H%g')))",
      ".unflatten(3, ((g.H // g.split('H%g')), g.split('H%g'))).transpose(3, 4)"), "random_slots"),
    # MXFP8's interleaved scales: token n's read from the next place of its tile, [(n + 1) % 32, n // 32]
    ("sglang_mha_mxfp8_interleaved__kv_planes_layer",
     ("(ck.off % 32), (ck.off // 32)", "((ck.off + 1) % 32), (ck.off // 32)"), "random_slots"),
])
def test_a_transposed_tile_fails_the_reference(module: str, edit: tuple[str, str], scenario: str) -> None:
    plan = PLANS[module]
    connector = connector_class(module, edit)(device="cpu", backend="torch")
    store_ok, load_ok = check_pair(connector, plan.paged, plan.obj, MORE[scenario])
    assert not store_ok and not load_ok


def test_the_compiled_mover_and_the_triton_kernels_walk_split_axes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each plane's program walks a split N as two dims (tile, place) and a split C as two shared
    dims, every extent read from the plane's views: the compiled kernel moves them, by default on
    a CPU. Each plane's Triton kernel has a split C as two dims of its row and a split N as two slot
    dims, extents and strides from the views too: its twin's KERNEL launches, and a named Triton
    mover prepares it (tests/test_kernels_planes.py runs it against the reference)."""
    for plan in PLANS.values():
        program = program_plan(plan)
        assert program.compiled is None and len(program.planes) == len(plan.planes)
        kernel = make_planes_kernel_plan(plan)
        assert isinstance(kernel, PlanesKernelPlan) and plan_refusal(plan) is None
        assert "no Triton kernel" not in (kernel_grid(plan) or "no Triton kernel")
        assert [p.slot[1:] for p in kernel.planes] == [dict(p.fields).get("slot_split", ("N",)) for p in program.planes]
    splits = {m: [dict(p.fields).get("slot_split", ()) for p in program_plan(plan).planes] for m, plan in PLANS.items()}
    assert splits["sglang_mha_vectorized_5d__kv_planes"] == [(), ("N/8", "N%8")]
    assert splits["sglang_mha_mxfp8_interleaved__kv_planes"] == [(), (), ("N/32", "N%32"), ("N/32", "N%32")]
    module = "sglang_mha_vectorized_5d__kv_planes"
    if native.compiler() is not None:
        assert connector_class(module)(device="cpu").copy_backend_for("cpu") == "native"
    twin = types.ModuleType(f"{module}_triton")
    text = next(k for k in MODULE_KINDS if k.field == "kernels").render(make_planes_kernel_plan(PLANS[module]))
    assert "kernels.Refused" not in text and "(cs_B, cs_N_t8, os_T, cs_N_p8, E_N_p8)" in text
    monkeypatch.setattr(kernels, "unavailable", lambda device: None)
    monkeypatch.setattr(kernels, "kernel_of", lambda name: twin)
    _, prepared = TritonMover().prepare(connector_class(module)(device="cpu"), torch.device("cpu"))
    assert prepared is twin


needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C compiler here")


@needs_compiler
@pytest.mark.parametrize("module", sorted(PLANS))
def test_the_compiled_mover_matches_the_reference_in_every_scenario(module: str) -> None:
    """backend="native": all 16 slot scenarios and the square ones, store and load, every call
    on the kernel (none fell back to torch)."""
    plan = PLANS[module]
    connector = connector_class(module)(device="cpu", backend="native")
    calls, fallbacks = native.stats["calls"], native.stats["fallbacks"]
    results = {name: check_pair(connector, plan.paged, plan.obj, sc) for name, sc in MORE.items()}
    assert all(ok == (True, True) for ok in results.values()), results
    assert native.stats["calls"] > calls and native.stats["fallbacks"] == fallbacks


#: K's cache places of vectorized_5d, [B H C/8 N C%8 E], from C/8 to C%8.
K_PLACES = "('{}', 2, ()),\n                ('N', 3, ()),\n                ('{}', 4, ())"
#: PROGRAM edits that swap a tile and its place: the plane's block slot (tokens of a block read
#: from place-major cells, a token's offset split by the tile count) or K's C/8 and C%8 dims.
SWAPS = [
    ("sglang_mha_mxfp8_interleaved__kv_planes", ("slot_split=('N/32', 'N%32')", "slot_split=('N%32', 'N/32')"),
     "random_slots"),
    ("sglang_mha_mxfp8_interleaved__kv_planes_layer", ("slot_split=('N/32', 'N%32')", "slot_split=('N%32', 'N/32')"),
     "partial_blocks"),
    ("sglang_mha_vectorized_5d__kv_planes", ("slot_split=('N/8', 'N%8')", "slot_split=('N%8', 'N/8')"),
     "square_blocks"),
    ("sglang_mha_vectorized_5d__kv_planes_layer", ("slot_split=('N/8', 'N%8')", "slot_split=('N%8', 'N/8')"),
     "square_pages"),
    ("sglang_mha_vectorized_5d__kv_planes", (K_PLACES.format("C/8", "C%8"), K_PLACES.format("C%8", "C/8")),
     "square_tiles"),
]


@needs_compiler
@pytest.mark.parametrize("module, edit, scenario", SWAPS)
def test_a_program_with_tile_and_place_swapped_fails_the_reference(module: str, edit: tuple[str, str],
                                                                   scenario: str) -> None:
    plan = PLANS[module]
    connector = connector_class(module, edit)(device="cpu", backend="native")
    assert check_pair(connector, plan.paged, plan.obj, MORE[scenario]) == (False, False)


def _swapped_strides(rows: list[list[int]]) -> list[list[int]]:
    """A token dim (kvcopy.c's fields: ext, idx, first, div, cs, cs2, tok, os, ls, div2, cs3) of a
    split slot with its tile's (cs2) and place's (cs3) cache strides swapped. Square pages keep the
    swapped addresses inside the block (tile and place have one extent); the block's own stride
    (cs) stays, so no token is sent into another block, or past the cache's end."""
    for r in rows:
        if r[9] > 1:  # a token's offset split into tile and place
            assert r[3] // r[9] == r[9], "not square: the swap would address outside the block"
            r[5], r[10] = r[10], r[5]
    return rows


@needs_compiler
@pytest.mark.parametrize(("break_", "scenario"), [("swap_strides", "square_blocks"), ("swap_strides", "square_pages"),
                                                  ("drop_last_tile", "square_blocks")])
def test_kernel_dims_with_a_tile_broken_fail_the_reference(scenario: str, break_: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The mover's own rows, broken after the plan (the kernel checks no bounds: the connector
    checked the true rows), each break kept inside the tensors: a split slot's tile and place at
    each other's cache strides (whole blocks and single tokens), or the last tile of every whole
    block left out (whole blocks only: among single tokens, AddressSanitizer saw that break read
    before the start of a tensor)."""
    module = "sglang_mha_vectorized_5d__kv_planes"
    slot_rows, token_row = native_mover._slot_rows, native_mover._token_row

    def slots(cache: Any, ext: Any, os_t: int, split: Any) -> list[list[int]]:
        rows = slot_rows(cache, ext, os_t, split)
        if split and break_ == "swap_strides":
            assert rows[0][0] == rows[1][0], "not square: the swap would address outside the block"
            rows[0][4], rows[1][4] = rows[1][4], rows[0][4]
        if split and break_ == "drop_last_tile":
            rows[0][0] -= 1
        return rows

    def tokens(*args: Any) -> list[int]:
        row = token_row(*args)
        return _swapped_strides([row])[0] if break_ == "swap_strides" else row

    monkeypatch.setattr(native_mover, "_slot_rows", slots)
    monkeypatch.setattr(native_mover, "_token_row", tokens)
    plan = PLANS[module]
    connector = connector_class(module)(device="cpu", backend="native")
    assert check_pair(connector, plan.paged, plan.obj, MORE[scenario]) == (False, False)


@needs_compiler
@pytest.mark.parametrize("module", ["sglang_mha_mxfp8_interleaved__kv_planes", "sglang_mha_vectorized_5d__kv_planes"])
def test_a_cache_tensor_one_tile_short_is_refused_before_any_write(module: str) -> None:
    """A split plane's tensor whose storage ends one tile of its last block early (memory freed
    under the view): store and load are refused and neither the objects nor the cache change."""
    plan = PLANS[module]
    sc = fitted(plan.paged, SCENARIOS["consecutive_blocks"])
    connector = connector_class(module)(device="cpu", backend="native")
    cache = make_cache(plan.paged, torch.bfloat16, "cpu", ext=sc.ext)
    part = next(i for i, p in enumerate(plan.paged.parts) if "N/8" in p.tensor_axes or "N/32" in p.tensor_axes)
    leaf, axes = cache[part][0], [d.axes[0] for d in plan.paged.parts[part].dims]
    tile = leaf.stride(next(i for i, a in enumerate(axes) if a.startswith("N/"))) * leaf.element_size()
    mapping = torch.arange(sum(e - s for s, e in zip(sc.starts, sc.ends, strict=False)), dtype=torch.long)
    lengths = [e - s for s, e in zip(sc.starts, sc.ends, strict=False)]
    connector.bind(cache)
    objs = make_objects(connector, lengths, torch.bfloat16, "cpu", salt=7)
    before_objs, before_cache = clone_tree([obj_tensors(o) for o in objs]), clone_tree(cache)
    leaf.untyped_storage().resize_(leaf.untyped_storage().nbytes() - tile)
    with pytest.raises(KVLayoutError, match="storage"):
        connector_store(connector, objs, sc, cache, mapping)
    with pytest.raises(KVLayoutError, match="storage"):
        connector_load(connector, objs, sc, cache, mapping)
    assert same_bits([obj_tensors(o) for o in objs], before_objs)
    assert all(same_bits(a, b) for i, (a, b) in enumerate(zip(cache, before_cache, strict=True)) if i != part)


@needs_compiler
def test_plane_extents_refuse_views_that_disagree_or_hold_too_few_slots() -> None:
    """The mover's own checks, before any call is made: a leaf one tile short of the geometry's
    block, an object view whose values differ from the cache's, and a leaf whose storage ends early."""
    plan = PLANS["sglang_mha_mxfp8_interleaved__kv_planes"]
    program = runtime_program(plan).planes[2]  # k_scale: [B H N%32 N/32 C E]
    g = types.SimpleNamespace(S=4 * 128, N=128)
    leaf, obj = (4, 2, 32, 4, 4, 1), (3, 10, 2, 4, 1)
    assert native_mover.plane_extents(program, leaf, obj, g)["N"] == 128
    with pytest.raises(Unsupported, match="slots"):
        native_mover.plane_extents(program, (4, 2, 32, 3, 4, 1), obj, g)
    with pytest.raises(Unsupported, match="plane axis C"):
        native_mover.plane_extents(program, leaf, (3, 10, 2, 5, 1), g)
    t = torch.zeros(leaf, dtype=torch.uint8)
    t.untyped_storage().resize_(t.numel() - 32 * 4 * 4)
    with pytest.raises(Unsupported, match="storage"):
        native_mover.LeafSet(None, [t], program.cache_places, program.cache_lists, {"L": 1})


def runtime_program(plan: PlanesPlan) -> Any:
    """The module's PROGRAM of a rendered tiled connector."""
    return connector_class(plan.module).program


def _cache(module: str) -> Any:
    plan = PLANS[module]
    sc = fitted(plan.paged, SCENARIOS["random_slots"])
    return make_cache(plan.paged, torch.bfloat16, "cpu", ext=sc.ext)


def test_read_geometry_solves_the_whole_axes_from_tile_times_place() -> None:
    module = "sglang_mha_vectorized_5d__kv_planes"
    cache = _cache(module)
    k, v = cache[0][0], cache[1][0]
    g = connector_class(module).read_geometry(cache)
    assert (g.N, g.H, g.planes[0].values, g.planes[1].values) == (k.shape[3], k.shape[1], k.shape[2] * k.shape[4],
                                                                  v.shape[3])
    assert g.N == v.shape[2] * v.shape[4]


@pytest.mark.parametrize("part, shape, message", [
    (0, lambda s: (*s[:4], 4), "C%8 must be 8, got 4"),  # K's place is not the factor
    (1, lambda s: (*s[:4], 4), "N%8 must be 8, got 4"),  # V's place is not the factor
    (1, lambda s: (s[0], s[1], s[2] * 2, s[3], s[4]), "N"),  # V's pages hold twice K's tokens
])
def test_read_geometry_refuses_tiles_that_do_not_fit(part: int, shape: Any, message: str) -> None:
    module = "sglang_mha_vectorized_5d__kv_planes"
    cache = _cache(module)
    bad = [list(layers) for layers in cache]
    bad[part] = [torch.zeros(shape(t.shape), dtype=t.dtype) for t in bad[part]]
    with pytest.raises(KVLayoutError, match=message):
        connector_class(module).read_geometry(tuple(bad))
