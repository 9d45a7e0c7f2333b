"""Connectors for caches with split (tiled) axes (spec format 3: `C/8` with `C%8`, `N/8` with `N%8`),
against the byte-level reference, which places every value from the spec's own address arithmetic
(kvgen.oracle.address): the built-in specs of SGLang's vectorized_5d pools (AITER's SHUFFLE layout,
tiles of 8 and of 16) and of MHATokenToKVPoolMXFP8's page-128 interleaved scales, whose addresses
tests/test_engine_sglang_vectorized_5d.py and tests/test_engine_sglang_mxfp8.py check against SGLang's kernels.

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
from harness import SCENARIOS, Scenario, block_table_mapping, make_cache, tiled_connector, tiled_library

from kvgen.emit.render import MODULE_KINDS
from kvgen.oracle.scenarios import check_pair, fitted
from kvgen.plan.kernel import RefusedKernelPlan, kernel_grid, make_planes_kernel_plan, plan_refusal
from kvgen.plan.package import plan_connectors
from kvgen.plan.planes import PlanesPlan
from kvgen.plan.program import program_plan
from kvgen.plan.splits import SPLITS_REASON
from kvgen.runtime import KVLayoutError, kernels
from kvgen.runtime.movers.base import Unsupported
from kvgen.runtime.movers.triton import TritonMover

LIBRARY = tiled_library()
NAMES = ("sglang_mha_vectorized_5d", "sglang_mha_vectorized_5d_fp8", "sglang_mha_mxfp8_interleaved")
PLANS = {p.module: p for p in plan_connectors(LIBRARY) if isinstance(p, PlanesPlan) and p.paged.name in NAMES}


def connector_class(module: str, edit: tuple[str, str] | None = None) -> Any:
    plan = PLANS[module]
    return tiled_connector(plan.paged.name, plan.obj.name, edit)


def test_each_tiled_spec_pairs_with_both_planes_objects() -> None:
    assert sorted(PLANS) == sorted(f"{n}__{o}" for n in NAMES for o in ("kv_planes", "kv_planes_layer"))


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("module", sorted(PLANS))
def test_every_scenario_matches_the_reference(module: str, backend: str | None) -> None:
    """All 16 slot scenarios (-1 at every place, partial and whole blocks, strided caches, odd
    storage offsets) through one connector, store and load, by default and on torch."""
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
    # MXFP8's interleaved scales: token n's read from the next place of its tile, [(n + 1) % 32, n // 32]
    ("sglang_mha_mxfp8_interleaved__kv_planes_layer",
     ("(ck.off % 32), (ck.off // 32)", "((ck.off + 1) % 32), (ck.off // 32)"), "random_slots"),
])
def test_a_transposed_tile_fails_the_reference(module: str, edit: tuple[str, str], scenario: str) -> None:
    plan = PLANS[module]
    connector = connector_class(module, edit)(device="cpu", backend="torch")
    store_ok, load_ok = check_pair(connector, plan.paged, plan.obj, MORE[scenario])
    assert not store_ok and not load_ok


def test_the_compiled_and_triton_movers_refuse_split_axes_and_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled kernel and the Triton kernel read each axis's extent from the geometry by name,
    which a tile or a place has not: PROGRAM says so, the twin's KERNEL refuses, auto picks torch
    and a named mover fails before anything moves."""
    for plan in PLANS.values():
        assert program_plan(plan).compiled == SPLITS_REASON
        kernel = make_planes_kernel_plan(plan)
        assert isinstance(kernel, RefusedKernelPlan) and kernel.why == SPLITS_REASON
        assert plan_refusal(plan) == SPLITS_REASON and kernel_grid(plan) == f"no Triton kernel: {SPLITS_REASON}"
    module = "sglang_mha_vectorized_5d__kv_planes"
    assert connector_class(module)(device="cpu").copy_backend_for("cpu") == "torch"
    with pytest.raises(KVLayoutError, match="backend='native'.*split"):
        connector_class(module)(device="cpu", backend="native").copy_backend_for("cpu")
    twin = types.ModuleType(f"{module}_triton")
    text = next(k for k in MODULE_KINDS if k.field == "kernels").render(make_planes_kernel_plan(PLANS[module]))
    exec(compile(text, twin.__name__, "exec"), twin.__dict__)
    assert isinstance(twin.KERNEL, kernels.Refused)
    monkeypatch.setattr(kernels, "unavailable", lambda device: None)
    monkeypatch.setattr(kernels, "kernel_of", lambda name: twin.KERNEL)
    with pytest.raises(Unsupported, match="no Triton kernel for this connector: split"):
        TritonMover().prepare(connector_class(module)(device="cpu"), torch.device("cpu"))


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
