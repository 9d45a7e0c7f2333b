"""Differential fuzz (hypothesis, bounded): every built-in connector, whole and layerwise,
one tensor or several planes, stores and loads the same bits on the path a connector takes by
default (on the CPU the compiled kernel) as on its generated torch code, and both as the
element-by-element reference does, for random chunkings, slot mappings with skipped tokens
anywhere, load prefixes left alone, strided caches and storage that starts off alignment.
The scenario tables (test_connectors) pin the known hard cases; this searches between them."""

from __future__ import annotations

import pytest
import torch
from harness import EXT, Scenario, builtin_plans
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgen import generated
from kvgen.oracle.scenarios import check_pair
from kvgen.runtime import native

PLANS = sorted(builtin_plans(), key=lambda p: p.module)
SLOTS = EXT["B"] * EXT["N"]

pytestmark = pytest.mark.skipif(bool(native.unavailable()), reason=f"no compiled kernel: {native.unavailable()}")


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[object, Scenario, list[int]]:
    plan = draw(st.sampled_from(PLANS))
    seq_len = draw(st.integers(1, SLOTS))
    slots = draw(st.permutations(range(SLOTS)))[:seq_len]
    if draw(st.booleans()):  # runs of whole consecutive blocks, as a block table gives them
        first = draw(st.integers(0, EXT["B"] - 1))
        slots = [(first * EXT["N"] + i) % SLOTS for i in range(seq_len)]
    skipped = draw(st.sets(st.integers(0, seq_len - 1), max_size=seq_len))
    mapping = [-1 if i in skipped else s for i, s in enumerate(slots)]
    cuts = sorted(draw(st.sets(st.integers(1, seq_len - 1), max_size=3))) if seq_len > 1 else []
    bounds = [0, *cuts, seq_len]
    chunks = [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if draw(st.booleans()) or a == 0]
    layout = draw(st.sampled_from(["plain", "strided", "odd_cache", "odd_objects"]))
    sc = Scenario("fuzz", tuple(a for a, _ in chunks), tuple(b for _, b in chunks), lambda r, e: list(mapping),
                  strided=layout == "strided", odd_cache=layout == "odd_cache", odd_objects=layout == "odd_objects",
                  skip=draw(st.integers(0, min(b - a for a, b in chunks))))
    return plan, sc, mapping


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_the_default_path_and_the_torch_path_agree_with_the_reference(case: tuple, dtype: torch.dtype) -> None:
    plan, sc, mapping = case
    results = {}
    for backend in (None, "torch"):
        connector = generated.get(plan.paged.name, plan.obj.name)(device="cpu", backend=backend)
        results[backend or "default"] = check_pair(connector, plan.paged, plan.obj, sc, dtype)
    assert results == {"default": (True, True), "torch": (True, True)}, \
        f"{plan.module}, chunks {list(zip(sc.starts, sc.ends, strict=True))}, skip {sc.skip}, mapping {mapping}"


def test_the_fuzz_reaches_the_compiled_path_and_both_kinds_of_cache() -> None:
    """Not a tautology: the plans it draws from hold layerwise connectors and caches of several
    planes, and a default connector of the first plan moves through the compiled kernel."""
    assert any(p.obj.name.endswith("layer") or "t2d" in p.obj.name for p in PLANS)
    assert any(not p.paged.is_simple for p in PLANS)
    plan = next(p for p in PLANS if p.paged.name == "vllm_flash_attn_nhd" and p.obj.name == "kv_2ltd")
    calls = native.stats["calls"]
    sc = Scenario("one", (0,), (8,), lambda r, e: list(range(8)))
    assert check_pair(generated.get(plan.paged.name, plan.obj.name)(device="cpu"), plan.paged, plan.obj, sc) \
        == (True, True)
    assert native.stats["calls"] > calls

