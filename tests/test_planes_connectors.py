"""Every format-2 connector (caches of several parts or typed fields, packed objects) against the
byte-level reference (kvgen.oracle.reference.planes), store and load, in every slot scenario.

Every byte of a cache carries a code of its part, tensor and position; every byte of an object
a code of its own. So a value, a field or a scale moved to the wrong token, the wrong plane or
the wrong offset changes bytes the comparison sees; the tampering tests below show it does.
"""

from __future__ import annotations

import random
import types
from dataclasses import replace
from typing import Any

import pytest
import torch
from harness import (
    EXT,
    SCENARIOS,
    Scenario,
    block_table_mapping,
    builtin_library,
    builtin_plans,
    clone_tree,
    connector_load,
    connector_store,
    make_cache,
    make_objects,
    obj_tensors,
    reference_load,
    reference_store,
    same_bits,
    tensors_of,
)

from kvgen import generated
from kvgen.emit.render import render_connector, seal
from kvgen.oracle.scenarios import check_backends, check_pair, fitted
from kvgen.plan.package import connector_plan
from kvgen.plan.planes import PlanesPlan
from kvgen.runtime import KVLayoutError, MemoryObj

LIBRARY = builtin_library()
PLANS = {p.module: p for p in builtin_plans() if isinstance(p, PlanesPlan)}


def test_every_format2_pair_is_generated() -> None:
    assert len(PLANS) >= 20
    assert set(PLANS) <= {f"{a}__{b}" for a, b in generated.CONNECTORS}


@pytest.mark.parametrize("module", sorted(PLANS))
def test_every_scenario_matches_the_reference(module: str, device: str) -> None:
    """All 16 slot scenarios (-1 at every place, partial blocks, strided caches, odd storage
    offsets of caches and objects) through one connector per mover, store and load: the mover a
    connector picks by default (the compiled kernel on a CPU with a compiler) and torch. Each
    connector meets every scenario in turn, as an engine keeps one; the reference runs once per
    scenario for both (check_backends)."""
    plan = PLANS[module]
    connectors = {backend: generated.get(plan.paged.name, plan.obj.name)(
        device=device, backend=None if backend == "default" else backend) for backend in ("default", "torch")}
    wrong = []
    for name, scenario in SCENARIOS.items():
        results = check_backends(list(connectors.values()), plan.paged, plan.obj, scenario)
        wrong += [(backend, name, r) for backend, r in zip(connectors, results, strict=True) if r != (True, True)]
    assert not wrong, f"(mover, scenario, (store ok, load ok)) that differ from the reference: {wrong}"


FREE = [m for m, p in PLANS.items() if any(len(part.dtypes) > 1 for part in p.paged.parts)]


@pytest.mark.parametrize("module", sorted(FREE))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_parts_of_other_dtypes(module: str, dtype: torch.dtype) -> None:
    plan = PLANS[module]
    assert check_pair(generated.get(plan.paged.name, plan.obj.name)(device="cpu"), plan.paged, plan.obj,
                      SCENARIOS["partial_blocks"], dtype) == (True, True)


def _setup(module: str, scenario: Scenario, device: str) -> tuple[Any, ...]:
    """(plan, connector, cache): the cache at the scenario's extents fitted to the spec's split
    factors (vectorized_5d's tiles of 8 and 16 need whole tiles of slots and of C)."""
    plan = PLANS[module]
    connector = generated.get(plan.paged.name, plan.obj.name)(device=device)
    cache = make_cache(plan.paged, torch.float32, device, ext=fitted(plan.paged, scenario).ext)
    connector.bind(cache)
    return plan, connector, cache


@pytest.mark.parametrize("module", sorted(PLANS))
def test_round_trip_into_zeroed_cache(module: str) -> None:
    sc = fitted(PLANS[module].paged, SCENARIOS["partial_blocks"])
    plan, connector, cache = _setup(module, sc, "cpu")
    mapping_list = sc.mapping(random.Random(module), dict(sc.ext))
    mapping = torch.tensor(mapping_list)
    objs = make_objects(connector, [sc.ends[0] - sc.starts[0]], torch.float32, "cpu", salt=3)
    connector_store(connector, objs, sc, cache, mapping)

    target = clone_tree(cache)
    for t in tensors_of(target):
        t.zero_()
    expected = clone_tree(target)
    connector_load(connector, objs, sc, target, mapping)
    reference_load(plan.paged, plan.obj, expected, objs, sc, mapping_list)
    assert same_bits(target, expected)
    # what was stored comes back: every moved slot's bytes equal the source cache's
    assert any(t.view(torch.uint8).any() if t.dim() else t.ne(0).item() for t in tensors_of(target))


@pytest.mark.parametrize("module", sorted(PLANS))
def test_skip_prefix_and_offset(module: str) -> None:
    plan, connector, cache = _setup(module, SCENARIOS["whole_blocks"], "cpu")
    ext = dict(fitted(plan.paged, SCENARIOS["whole_blocks"]).ext)
    full = block_table_mapping(24, random.Random(module), ext)
    full[9] = -1
    offset = 8
    sc = Scenario("offset", (8, 16), (16, 24), lambda r, e: full[offset:], offset=offset, ext=ext)
    partial = torch.tensor(full[offset:])
    objs = make_objects(connector, [8, 8], torch.float32, "cpu", salt=9, fmt=connector.format)
    expected = clone_tree(cache)
    connector_load(connector, objs, replace(sc, skip=3), cache, partial)
    reference_load(plan.paged, plan.obj, expected, objs, replace(sc, skip=3), full[offset:])
    assert same_bits(cache, expected)

    stored = make_objects(connector, [8, 8], torch.float32, "cpu", salt=11)
    want = make_objects(connector, [8, 8], torch.float32, "cpu", salt=11)
    connector_store(connector, stored, sc, cache, partial)
    reference_store(plan.paged, plan.obj, cache, want, sc, full[offset:])
    assert same_bits([obj_tensors(o) for o in stored], [obj_tensors(o) for o in want])


@pytest.mark.parametrize("module", sorted(m for m, p in PLANS.items() if p.mode == "layerwise"))
def test_layerwise_yield_counts_with_nothing_to_move(module: str) -> None:
    plan, connector, cache = _setup(module, SCENARIOS["minus1_all"], "cpu")
    before = clone_tree(cache)
    sc = Scenario("empty", (0, 4), (4, 4), lambda r, e: [-1] * 4, ext=fitted(plan.paged, SCENARIOS["minus1_all"]).ext)
    objs = make_objects(connector, [4, 0], torch.float32, "cpu", salt=2, fmt=connector.format)
    assert connector_store(connector, objs, sc, cache, torch.full((4,), -1)) == EXT["L"] + 1
    assert connector_load(connector, objs, sc, cache, torch.full((4,), -1)) == EXT["L"] + 2
    assert same_bits(cache, before)


def test_per_layer_scales_travel_with_chunks_that_move_a_token() -> None:
    """A per-tensor scale has no slot: a store copies it into every chunk's object, a load
    writes it from a chunk that moves a token, and a chunk of -1 slots leaves it alone."""
    connector = generated.get("vllm_fp8_tensor_scales", "kv_planes")()
    cache = make_cache(LIBRARY["vllm_fp8_tensor_scales"], torch.float32, "cpu")
    connector.bind(cache)
    scales = [(layer[1], layer[2]) for layer in cache]
    objs = make_objects(connector, [4, 4], torch.float32, "cpu", salt=1, fmt=connector.format)
    before = [(k.clone(), v.clone()) for k, v in scales]
    connector.batched_to_gpu(objs, [0, 4], [4, 8], kvcaches=cache, slot_mapping=torch.full((8,), -1))
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(scales, before, strict=True))
    mapping = torch.tensor([-1, -1, -1, -1, 5, -1, -1, -1])
    connector.batched_to_gpu(objs, [0, 4], [4, 8], kvcaches=cache, slot_mapping=mapping)
    assert not all(torch.equal(k, k0) for (k, _), (k0, _) in zip(scales, before, strict=True))


def test_an_object_of_the_wrong_dtype_or_size_is_refused() -> None:
    connector = generated.get("vllm_gaudi_fp8", "kv_planes")()
    cache = make_cache(LIBRARY["vllm_gaudi_fp8"], torch.float32, "cpu")
    shape = connector.get_shape(4, cache)
    assert connector.get_dtype() == torch.uint8
    for bad in (torch.zeros(shape, dtype=torch.float32), torch.zeros((shape[0], shape[1] + 16), dtype=torch.uint8)):
        with pytest.raises(KVLayoutError, match="memory object must be kv_planes"):
            connector.from_gpu(MemoryObj(bad), 0, 4, kvcaches=cache, slot_mapping=torch.arange(4))


def test_a_cache_whose_parts_disagree_is_refused() -> None:
    connector = generated.get("vllm_gaudi_fp8", "kv_planes")()
    cache = make_cache(LIBRARY["vllm_gaudi_fp8"], torch.float32, "cpu")
    short = [list(layer) for layer in cache]
    short[0][2] = short[0][2][:-1]
    with pytest.raises(KVLayoutError, match="part k_scale: every tensor must have one shape"):
        connector.bind(short)
    missing = [layer[:3] for layer in cache]
    with pytest.raises(KVLayoutError, match="level P must hold the 4 parts"):
        connector.bind(missing)
    wrong_dtype = [(*layer[:2], layer[2].float(), layer[3]) for layer in cache]
    with pytest.raises(KVLayoutError, match="part k_scale: dtype float32 is not one of bfloat16"):
        connector.bind(wrong_dtype)
    # rows move as bytes: a K tensor whose last dim is not contiguous is refused before any copy
    k = torch.zeros(2, 4, EXT["B"] * EXT["N"], dtype=torch.float8_e4m3fn).permute(2, 0, 1)
    with pytest.raises(KVLayoutError, match="part k: the last dim of every tensor must be contiguous"):
        connector.bind([(k, *layer[1:]) for layer in cache])


# -- the comparisons can fail: connectors tampered with must disagree with the reference --------

def _tampered(module: str, plane: str, old: str, new: str) -> Any:
    """The connector of `module` with `old` replaced by `new` in the section of one plane."""
    text = render_connector(connector_plan(PLANS[module]))
    head = f"# plane {plane}\n"
    parts = text.split(head)
    assert len(parts) == 3, "one section per direction"
    for i in (1, 2):
        section, rest = parts[i].split("# plane ", 1) if "# plane " in parts[i] else (parts[i], None)
        assert old in section
        parts[i] = section.replace(old, new) + (f"# plane {rest}" if rest is not None else "")
    source = seal(f"{module}.py", head.join(parts))
    space = types.ModuleType(module)
    exec(compile(source, module, "exec"), space.__dict__)
    return space.Connector


@pytest.mark.parametrize("module, plane, old, new, scenario", [
    # a per-token-head scale read from the neighbouring token's slot
    ("vllm_gaudi_fp8__kv_planes", "k_scale", "ck.slots", "ck.slots.roll(1)", "random_slots"),
    # the indexer's fp32 scale taken from the block's region one token later
    ("vllm_dsa_indexer__kv_mla_rows", "scale", "ck.off]", "(ck.off + 1) % g.N]", "random_slots"),
    # the fp8 MLA row's scales read two scales along
    ("vllm_mla_fp8__kv_planes", "scale", "512, 16)", "520, 16)", "whole_blocks"),
    # a per-tensor scale written by a chunk that moves no token
    ("vllm_fp8_tensor_scales__kv_planes", "k_scale", "if ck.moved:", "if True:", "minus1_all"),
])
def test_a_misplaced_scale_fails_the_comparison(module: str, plane: str, old: str, new: str, scenario: str) -> None:
    """The tampered code is the generated torch copy, so it runs on the torch mover."""
    plan = PLANS[module]
    wrong = _tampered(module, plane, old, new)
    assert check_pair(generated.get(plan.paged.name, plan.obj.name)(device="cpu"), plan.paged, plan.obj,
                      SCENARIOS[scenario]) == (True, True)
    assert check_pair(wrong(device="cpu", backend="torch"), plan.paged, plan.obj, SCENARIOS[scenario]) != (True, True)


@pytest.mark.parametrize("module, plane, old, new, scenario", [
    ("vllm_gaudi_fp8__kv_planes", "k_scale", "ck.slots", "ck.slots.roll(1)", "random_slots"),
    ("vllm_mla_fp8__kv_planes", "scale", "512, 16)", "520, 16)", "odd_offset_objects"),
])
def test_one_reference_for_several_movers_still_names_the_wrong_one(module: str, plane: str, old: str, new: str,
                                                                   scenario: str) -> None:
    """check_backends, beside a right connector, finds a connector tampered in both directions wrong
    both ways: its store against the shared reference, its load of the reference's objects."""
    plan = PLANS[module]
    right = generated.get(plan.paged.name, plan.obj.name)(device="cpu", backend="torch")
    wrong = _tampered(module, plane, old, new)(device="cpu", backend="torch")
    assert check_backends([right, wrong], plan.paged, plan.obj, SCENARIOS[scenario]) == [(True, True), (False, False)]
