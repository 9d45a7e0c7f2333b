"""The generated Triton kernels of format-2 connectors (caches of several planes): their
plans, a representative subset against the reference (on the CPU through Triton's
interpreter), the word each plane moves in, and all-or-nothing launches.

`kvgen verify --backend triton` runs every one of them (in Triton's interpreter, through each
scenario whose launches take a kernel path no earlier one took).
"""

from __future__ import annotations

import importlib.util
import random
from dataclasses import replace
from typing import Any

import pytest
import torch
from harness import (
    EXT,
    SCENARIOS,
    builtin_plans,
    connector_load,
    connector_store,
    make_cache,
    make_objects,
)
from test_kernels import interpreted
from test_split_connectors import SQUARE, SQUARE_BLOCKS, SQUARE_N

from kvgen import generated
from kvgen.oracle.scenarios import check_connector, check_pair, clone_tree, same_bits
from kvgen.plan.kernel import (
    PARTIAL_SLOT_REASON,
    PlanesKernelPlan,
    kernel_grid,
    make_planes_kernel_plan,
    plan_refusal,
    slot_refusal,
)
from kvgen.plan.planes import PlanesPlan
from kvgen.runtime import KVLayoutError, kernels
from kvgen.tools.verify.connectors import INTERPRETER_LAYERS

PLANS = [p for p in builtin_plans() if isinstance(p, PlanesPlan)]
#: Caches of whole axes, and caches with split (tiled) axes (tile and place dims of a plane's row or block slot).
PARTS = {p.module: p for p in PLANS if not p.tiled}
TILED = {p.module: p for p in PLANS if p.tiled}
HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install 'kvgen[triton]')")

#: One connector per way a plane is reached, with the slot patterns that matter for it.
SUBSET = {
    # planes without slots (per-layer scales) next to a [KV B N H C] part, regions
    "vllm_fp8_tensor_scales__kv_planes": ["partial_blocks", "minus1_all", "odd_offset_objects"],
    # fields at byte offsets in each row, into rows, per layer
    "vllm_mla_fp8__kv_mla_rows_layer": ["random_slots", "odd_offset_objects"],
    # fields laid out per block
    "vllm_dsa_indexer__kv_planes": ["consecutive_blocks", "minus1_chunk_ends", "strided_cache"],
    # folded slot axes, per-head scales, per layer
    "vllm_gaudi_fp8__kv_planes_layer": ["random_slots", "odd_offset_cache"],
    # parts outside layers: kvcaches[part][layer]
    "sglang_mha_v_head__kv_planes": ["partial_blocks"],
}


def _kernel_device(device: str) -> None:
    why = kernels.unavailable(torch.device(device))
    if why:
        pytest.skip(why)


# -- plans (no torch, no triton) ---------------------------------------------------------------

@pytest.mark.parametrize("module", list(PARTS))
def test_plane_kernels_cover_every_value_once(module: str) -> None:
    """Per plane: each value axis is in the row, enumerated by grid axis 1, or the fixed
    layer; slots are (B, N), a folded S, or none for a plane without slots."""
    k = make_planes_kernel_plan(PARTS[module])
    assert [p.name for p in k.planes] == [pc.plane.name for pc in PARTS[module].planes]
    for plane, pc in zip(k.planes, PARTS[module].planes, strict=True):
        values = {"L", *(a for a in plane.leaf.axes if a not in ("B", "N", "S"))}
        fixed = ["L"] if k.layerwise else []
        assert sorted([*plane.row, *plane.outer, *fixed]) == sorted(values)
        assert plane.slot == (() if pc.slotless else ("S",) if "S" in plane.leaf.axes else ("B", "N"))
        assert "C" in plane.row and "wd[" not in "\n".join(plane.views)


def test_kernel_plans_of_known_layouts() -> None:
    scales = make_planes_kernel_plan(PARTS["vllm_fp8_tensor_scales__kv_planes"])
    assert [(p.name, p.slotless, p.row, p.outer) for p in scales.planes] == [
        ("kv", False, ("KV", "H", "C"), ("L",)), ("k_scale", True, ("C",), ("L",)), ("v_scale", True, ("C",), ("L",))]
    assert "(0, 0, 0), (BN, TILE, VA)" in "\n".join(scales.planes[1].body)  # every slot stride 0
    assert scales.leaves == "[kvcaches[layer][plane] for layer in range(g.L)]"
    sglang = make_planes_kernel_plan(PARTS["sglang_mha_v_head__kv_planes_layer"])
    assert sglang.leaves == "[kvcaches[plane][layer] for layer in range(g.L)]"
    assert [p.slot for p in sglang.planes] == [("S",), ("S",)] and all(p.outer == () for p in sglang.planes)


# -- kernels against the reference -------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("module", list(SUBSET))
def test_planes_kernel_matches_reference(module: str, device: str) -> None:
    _kernel_device(device)
    plan = PARTS[module]
    before = kernels.stats["launches"]
    results = check_connector(generated, plan.paged, plan.obj, device, interpreted(SUBSET[module], device),
                              backend="triton")
    wrong = [(s, r) for s, r in zip(SUBSET[module], results, strict=True) if r != (True, True)]
    assert not wrong, f"(store ok, load ok) differ from the reference: {wrong}"
    assert kernels.stats["launches"] > before, "the kernels never ran"


def _captured(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    real = kernels._launch

    def capture(fn: Any, grid: Any, args: dict[str, Any], device: Any) -> None:
        seen.append(dict(args))
        real(fn, grid, args, device)

    monkeypatch.setattr(kernels, "_launch", capture)
    return seen


@needs_triton
@pytest.mark.parametrize("scenario", ["partial_blocks", "odd_offset_objects"])
def test_each_plane_moves_in_its_widest_word(scenario: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 MLA rows: 512, 16 and 128 bytes at byte 0, 512 and 528 of a 656-byte row; each
    plane moves in the word the torch code picks for this call (8 bytes here, narrower
    where the object starts one element into its storage), one launch per plane."""
    _kernel_device(device)
    plan = PARTS["vllm_mla_fp8__kv_mla_rows"]
    seen = _captured(monkeypatch)
    assert check_connector(generated, plan.paged, plan.obj, device, [SCENARIOS[scenario]],
                           backend="triton") == [(True, True)]
    assert len(seen) == 2 * 3 * 1  # store and load, 3 planes, one chunk
    widths = [args["cache"].element_size() for args in seen[:3]]
    assert widths == [args["obj"].element_size() for args in seen[:3]]
    if scenario == "partial_blocks":
        assert widths == [8, 8, 8]
    else:
        assert max(widths) < 8


@needs_triton
def test_a_plane_that_cannot_launch_leaves_everything_untouched(device: str, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """Every plane's launch is prepared before the first runs: when the last plane cannot
    be addressed, forced triton refuses with nothing written and auto moves the chunk by
    the torch ops."""
    _kernel_device(device)
    plan = PARTS["vllm_fp8_tensor_scales__kv_planes"]
    connector = generated.get(plan.paged.name, plan.obj.name)
    planes = kernels.kernel_of(connector.__module__)
    last = planes.planes[-1]

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise kernels.Unsupported("this plane cannot be addressed")

    monkeypatch.setattr(last, "arguments", refuse)
    sc = SCENARIOS["partial_blocks"]
    cache = make_cache(plan.paged, torch.float32, device)
    mapping = torch.tensor(sc.mapping(random.Random(0), EXT), device=device)
    forced = connector(device=device, backend="triton")
    forced.bind(cache)
    objs = make_objects(forced, [13], torch.float32, device, salt=3, fmt=forced.format)
    untouched = clone_tree(cache)
    before = kernels.stats["launches"]
    with pytest.raises(KVLayoutError, match="this plane cannot be addressed"):
        connector_load(forced, objs, sc, cache, mapping)
    assert same_bits(cache, untouched) and kernels.stats["launches"] == before

    auto = connector(device=device)
    auto._pin(torch.device(device), "triton", (auto, planes))
    connector_store(auto, objs, sc, cache, mapping)
    assert kernels.stats["launches"] == before
    reference = connector(device=device, backend="torch")
    reference.bind(untouched)
    twin = make_objects(reference, [13], torch.float32, device, salt=3, fmt=reference.format)
    connector_store(reference, twin, sc, untouched, mapping)
    assert same_bits([o.tensor for o in objs], [o.tensor for o in twin])



# -- split (tiled) axes: a split C or H is two dims of a plane's row, a split N two slot dims -----------------------

#: Every scenario SUBSET runs for a planes kernel, and square tiles and pages (a tile and its place of one
#: extent, so that one taken for the other stays inside the tensors and only the values tell them apart).
SPLIT_SCENARIOS = sorted({s for names in SUBSET.values() for s in names})
SQUARES = {s.name: replace(s, ext={**s.ext, "L": INTERPRETER_LAYERS}) for s in (SQUARE, SQUARE_N, SQUARE_BLOCKS)}


def test_split_axes_are_row_dims_and_slot_dims_of_the_plane_kernels() -> None:
    five = make_planes_kernel_plan(TILED["sglang_mha_vectorized_5d__kv_planes"])
    assert isinstance(five, PlanesKernelPlan)
    assert [(p.name, p.slot, p.row, p.outer) for p in five.planes] == [
        ("k", ("B", "N"), ("H", "C/8", "C%8", "E"), ("L",)), ("v", ("B", "N/8", "N%8"), ("H", "C", "E"), ("L",))]
    k, v = (dict(p.spec_fields) for p in five.planes)
    assert "split" not in k and k["idents"] == (("C/8", "C_t8"), ("C%8", "C_p8"))
    assert v["split"] == ("N/8", "N%8") and v["extents"] == ("N%8",) and v["blocks"]
    assert "(cs_B, cs_N_t8, os_T, cs_N_p8, E_N_p8)" in "\n".join(five.planes[1].body)
    mx = make_planes_kernel_plan(TILED["sglang_mha_mxfp8_interleaved__kv_planes_layer"])
    assert [p.slot for p in mx.planes] == [("B", "N"), ("B", "N"), ("B", "N/32", "N%32"), ("B", "N/32", "N%32")]
    tiled = ("sglang_mha_vectorized_5d", "sglang_mha_vectorized_5d_fp8", "sglang_mha_mxfp8_interleaved",
             "hicache_page_unified_grouped")
    assert sorted(TILED) == sorted(f"{n}__{o}" for n in tiled for o in ("kv_planes", "kv_planes_layer"))
    for plan in TILED.values():
        assert plan_refusal(plan) is None and "rows [H" in (kernel_grid(plan) or "")
    grouped = make_planes_kernel_plan(TILED["hicache_page_unified_grouped__kv_planes_layer"])
    assert isinstance(grouped, PlanesKernelPlan)  # H split by a factor read from the tensor: a row dim and an outer one
    assert [(p.slot, p.row, p.outer) for p in grouped.planes] == [(("B", "N"), ("H%g", "C", "E"), ("KV", "H/g"))]
    assert grouped.leaves == "[kvcaches.select(2, layer) for layer in range(g.L)]"  # L a dim of the one tensor
    assert slot_refusal(("B", "H", "N/8", "C")) == PARTIAL_SLOT_REASON
    assert slot_refusal(("B", "H", "N%8", "C")) == PARTIAL_SLOT_REASON
    assert slot_refusal(("B", "N%8", "H", "N/8")) is None and slot_refusal(("B", "N", "H")) is None


@needs_triton
@pytest.mark.parametrize("module", sorted(TILED))
def test_split_plane_kernels_match_the_reference(module: str, device: str) -> None:
    """Every scenario the other planes kernels run and the square ones, store and load, each through
    the kernels (none fell back to the torch path)."""
    _kernel_device(device)
    plan = TILED[module]
    launches, fallbacks = kernels.stats["launches"], kernels.stats["fallbacks"]
    scenarios = [*interpreted(SPLIT_SCENARIOS, device), *SQUARES.values()]
    results = check_connector(generated, plan.paged, plan.obj, device, scenarios, backend="triton")
    wrong = [(s.name, r) for s, r in zip(scenarios, results, strict=True) if r != (True, True)]
    assert not wrong, f"(store ok, load ok) differ from the reference: {wrong}"
    assert kernels.stats["launches"] > launches and kernels.stats["fallbacks"] == fallbacks


def _broken_launches(monkeypatch: pytest.MonkeyPatch, break_: str) -> None:
    """Every launch of a plane with a split block slot, broken after the plan: the tile's and the
    place's cache strides swapped, or the last tile dropped (whole blocks one tile short; a single
    token's offset in its block read in tiles of twice the place, since a shorter block would
    send the slots of the last blocks past the cache's end). Each break stays inside the tensors
    the kernel is given (asserted: every slot's block as before, no offset in a block past the
    furthest one the true launch reaches): the interpreter writes where the addresses say."""
    real = kernels._launch

    def launch(fn: Any, grid: Any, args: dict[str, Any], device: Any) -> None:
        tile, place = (next((k for k in args if k.startswith(p)), None) for p in ("cs_N_t", "cs_N_p"))
        broken = args
        if tile and place and break_ == "swap_strides":
            broken = {**args, tile: args[place], place: args[tile]}
        if tile and place and break_ == "drop_last_tile":
            extent = "E" + place[2:]
            broken = ({**args, extent: 2 * args[extent]} if args["SLOTS"]
                      else {**args, "BN": args["BN"] - args[extent]})
        if tile and place:
            assert broken["BN"] == args["BN"] or not args["SLOTS"]
            assert _reach(broken, tile, place) <= _reach(args, tile, place)
        real(fn, grid, broken, device)

    monkeypatch.setattr(kernels, "_launch", launch)


def _reach(args: dict[str, Any], tile: str, place: str) -> int:
    """The furthest cache offset within a block that a launch's split slot addresses."""
    extent = args["E" + place[2:]]
    return (args["BN"] // extent - 1) * args[tile] + (extent - 1) * args[place]


@needs_triton
@pytest.mark.parametrize("scenario", ["square_blocks", "square_pages"])
@pytest.mark.parametrize("break_", ["swap_strides", "drop_last_tile"])
def test_a_split_slot_broken_at_launch_fails_the_reference(scenario: str, break_: str, device: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _kernel_device(device)
    plan = TILED["sglang_mha_vectorized_5d__kv_planes"]
    connector = generated.get(plan.paged.name, plan.obj.name)(device=device, backend="triton")
    assert check_pair(connector, plan.paged, plan.obj, SQUARES[scenario]) == (True, True)
    _broken_launches(monkeypatch, break_)
    assert check_pair(connector, plan.paged, plan.obj, SQUARES[scenario]) == (False, False)


@needs_triton
def test_a_split_slot_whose_views_hold_a_tile_too_few_is_refused_before_any_launch(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """V's cache view one tile short of a block (N/8 x N%8 below N): the launch refuses before any
    plane moves, so a slot's offset never reaches past the view's last tile."""
    _kernel_device(device)
    plan = TILED["sglang_mha_vectorized_5d__kv_planes"]
    connector = generated.get(plan.paged.name, plan.obj.name)
    v = kernels.kernel_of(connector.__module__).planes[1]
    real = v.operands

    def short(x: torch.Tensor, o: torch.Tensor, *rest: Any) -> Any:
        return real(x.narrow(v.spec.cache_axes.index("N/8"), 0, x.shape[v.spec.cache_axes.index("N/8")] - 1), o, *rest)

    monkeypatch.setattr(v, "operands", short)
    launches = kernels.stats["launches"]
    with pytest.raises(KVLayoutError, match="N/8 x N%8 slots in the views are not its"):
        check_pair(connector(device=device, backend="triton"), plan.paged, plan.obj, SQUARES["square_blocks"])
    assert kernels.stats["launches"] == launches
