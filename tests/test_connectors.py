"""Every generated connector, store and load, against the reference interpreter.

Cache elements carry the code of their coordinates (layer, kv, slot, head, c) and
objects carry codes of their own positions, so a K/V swap, a transposed head or a
misplaced token changes bits that the comparison sees. Comparisons are bitwise.

Each case runs twice: on the path a connector takes by default (on the CPU the compiled
kernel, where a compiler is found) and on the generated torch code (`backend="torch"`), what
GPUs without Triton and CPUs without a compiler use.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from harness import (
    EXT,
    SCENARIOS,
    Scenario,
    at_odd_offsets,
    block_table_mapping,
    builtin_library,
    clone_tree,
    connector_load,
    connector_store,
    fitted,
    make_cache,
    make_objects,
    manager_extents,
    obj_tensors,
    reference_load,
    reference_store,
    same_bits,
    tensors_of,
)

from kvgen import generated
from kvgen.oracle.scenarios import check_connector
from kvgen.plan.copy import plan_library
from kvgen.runtime import KVLayoutError

LIBRARY = builtin_library()
PLANS = {p.module: p for p in plan_library(LIBRARY)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)

CASES = [(m, s, torch.float32) for m in PLANS for s in SCENARIOS]
CASES += [(m, "partial_blocks", d) for m in PLANS for d in DTYPES[1:]]


def _ids(case: tuple) -> str:
    return f"{case[0]}-{case[1]}-{str(case[2]).removeprefix('torch.')}"


#: How the tables run each case: the connector's own choice (backend None), and the torch ops.
BACKENDS = {"default": None, "torch": "torch"}


def _setup(module: str, scenario: str, dtype: torch.dtype, device: str, backend: str | None = "torch"):
    plan = PLANS[module]
    sc = fitted(plan.paged, SCENARIOS[scenario])  # EXT, or blocks of k slots per token for a pooled cache
    rng = random.Random(f"{module}/{scenario}")
    mapping_list = sc.mapping(rng, manager_extents(plan.paged, sc.ext))
    mapping = torch.tensor(mapping_list, dtype=torch.long, device=device)
    connector = generated.get(plan.paged.name, plan.obj.name)(device=device, backend=backend)
    cache = make_cache(plan.paged, dtype, device, sc.strided, sc.odd_cache, ext=sc.ext)
    connector.bind(cache)
    return plan, sc, mapping_list, mapping, connector, cache


def _store_case(case: tuple, backend: str | None, device: str) -> None:
    plan, sc, mapping_list, mapping, connector, cache = _setup(*case, device, backend)
    lengths = [e - s for s, e in zip(sc.starts, sc.ends, strict=False)]
    objs = make_objects(connector, lengths, case[2], device, salt=7)
    objs = at_odd_offsets(objs) if sc.odd_objects else objs
    expected = make_objects(connector, lengths, case[2], device, salt=7)
    before = clone_tree(cache)

    yields = connector_store(connector, objs, sc, cache, mapping)

    def reference() -> list[torch.Tensor]:
        reference_store(plan.paged, plan.obj, cache, expected, sc, mapping_list)
        return [o.tensor for c in expected for o in (c if isinstance(c, list) else [c])]

    got = [o.tensor for c in objs for o in (c if isinstance(c, list) else [c])]
    want = _reference_of(("store", case, device), reference)
    assert same_bits(got, want), "stored object differs from the reference"
    assert same_bits(cache, before), "a store changed the cache"
    assert yields == (EXT["L"] + 1 if connector.layerwise else 0)
    fmts = {(o.metadata.fmt.name) for c in objs for o in (c if isinstance(c, list) else [c])}
    assert fmts == {plan.obj.format}


def _load_case(case: tuple, backend: str | None, device: str) -> None:
    plan, sc, mapping_list, mapping, connector, cache = _setup(*case, device, backend)
    lengths = [e - s for s, e in zip(sc.starts, sc.ends, strict=False)]
    objs = make_objects(connector, lengths, case[2], device, salt=500, fmt=connector.format)
    objs = at_odd_offsets(objs) if sc.odd_objects else objs
    expected = clone_tree(cache)

    def reference() -> list[torch.Tensor]:
        reference_load(plan.paged, plan.obj, expected, objs, sc, mapping_list)
        return tensors_of(expected)

    want = _reference_of(("load", case, device), reference)  # before the connector: objs as made
    yields = connector_load(connector, objs, sc, cache, mapping)

    assert same_bits(tensors_of(cache), want), "loaded cache differs from the reference"
    assert yields == (EXT["L"] + 2 if connector.layerwise else 0)


#: The reference's result of each case of the module the tables are on: a case's inputs are made
#: the same whichever backend runs it (seeded by module and scenario), so the reference runs once
#: for both backends (the pytest items of one module's backends come one after the other).
_REFERENCES: dict[tuple, list[torch.Tensor]] = {}


def _reference_of(key: tuple, reference: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
    """The reference's tensors for `key` (kind, case, device), computed on the first ask."""
    if key not in _REFERENCES:
        if any(k[1][0] != key[1][0] for k in _REFERENCES):  # another module's: done with
            _REFERENCES.clear()
        _REFERENCES[key] = [t.clone() for t in reference()]
    return _REFERENCES[key]


def _failures(check, module: str, backend: str, device: str) -> list[str]:
    """Run `check` on every case of one connector (each scenario in float32, partial_blocks in
    every dtype); one item per connector keeps pytest's per-item cost off thousands of small
    cases, and each failing case is named with what it raised."""
    failed = []
    for case in CASES_OF[module]:
        try:
            check(case, BACKENDS[backend], device)
        except Exception as e:  # noqa: BLE001 - every case runs; the item fails naming each one
            failed.append(f"{_ids(case)}[{backend}]: {type(e).__name__}: {str(e).partition(chr(10))[0]}")
    return failed


CASES_OF = {m: [c for c in CASES if c[0] == m] for m in PLANS}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("module", list(PLANS))
def test_store_matches_reference(module: str, backend: str, device: str) -> None:
    failed = _failures(_store_case, module, backend, device)
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("module", list(PLANS))
def test_load_matches_reference(module: str, backend: str, device: str) -> None:
    failed = _failures(_load_case, module, backend, device)
    assert not failed, "\n".join(failed)


def test_minus1_scenarios_cover_every_position() -> None:
    """-1 slots before, inside, between and after whole blocks, at both ends of chunks and
    in every token; the tests above run each scenario, store and load, on every connector."""
    n = EXT["N"]

    def chunks(name: str) -> list[list[int]]:
        sc = SCENARIOS[name]
        mapping = sc.mapping(random.Random(0), EXT)
        return [mapping[s:e] for s, e in zip(sc.starts, sc.ends, strict=True)]

    def whole(c: list[int], i: int) -> bool:
        return c[i] >= 0 and c[i] % n == 0 and c[i:i + n] == list(range(c[i], c[i] + n))

    (c,) = chunks("minus1_before_blocks")
    assert c[:3] == [-1] * 3 and whole(c, 3)
    (c,) = chunks("minus1_inside_block")
    assert whole(c, 0) and c[n + 1] == -1 and whole(c, 2 * n)
    (c,) = chunks("minus1_between_blocks")
    assert whole(c, 0) and c[n] == -1 and whole(c, n + 1)
    assert chunks("minus1_after_blocks") == [[8, 9, 10, 11, 20, 21, 22, 23, 28, 29, -1, 31]]
    (c,) = chunks("minus1_after_consecutive_blocks")
    assert whole(c, 0) and c[n] == c[0] + n and c[2 * n] == -1
    ends = chunks("minus1_chunk_ends")
    assert all(c[0] == -1 and c[-1] == -1 for c in ends) and set(ends[1]) == {-1}
    assert any(whole(c, i) for c in ends for i in range(len(c) - n + 1))
    assert {s for c in chunks("minus1_all") for s in c} == {-1}
    assert {(m, s) for m, s, d in CASES if d == torch.float32} == {(m, s) for m in PLANS for s in SCENARIOS}


#: One connector, caches and objects of other strides and storage offsets in turn: a wide
#: copy word worked out for one cache must not be used for the next.
SEQUENCE = ["whole_blocks", "strided_cache", "minus1_between_blocks", "odd_offset_cache", "whole_blocks",
            "odd_offset_objects", "minus1_after_blocks"]


@pytest.mark.parametrize("module", list(PLANS))
def test_one_connector_meets_caches_of_other_strides(module: str, device: str) -> None:
    plan = PLANS[module]
    results = check_connector(generated, plan.paged, plan.obj, device, [SCENARIOS[s] for s in SEQUENCE])
    wrong = [(name, r) for name, r in zip(SEQUENCE, results, strict=True) if r != (True, True)]
    assert not wrong, f"(store ok, load ok) differ from the reference: {wrong}"


@pytest.mark.parametrize("module", list(PLANS))
def test_round_trip_into_zeroed_cache(module: str, device: str) -> None:
    plan, sc, mapping_list, mapping, connector, cache = _setup(module, "partial_blocks", torch.float32, device)
    lengths = [e - s for s, e in zip(sc.starts, sc.ends, strict=False)]
    objs = make_objects(connector, lengths, torch.float32, device, salt=3)
    connector_store(connector, objs, sc, cache, mapping)

    target = clone_tree(cache)
    for t in tensors_of(target):
        t.zero_()
    expected = clone_tree(target)
    connector_load(connector, objs, sc, target, mapping)
    reference_load(plan.paged, plan.obj, expected, objs, sc, mapping_list)
    assert same_bits(target, expected)
    moved = [s for s in mapping_list[sc.starts[0]:sc.ends[0]] if s >= 0]
    assert moved and any(t.abs().sum() > 0 for t in tensors_of(target))


@pytest.mark.parametrize("module", list(PLANS))
def test_skip_prefix_and_offset(module: str, device: str) -> None:
    """vLLM's skip_prefix_n_tokens leaves a chunk's first tokens alone on load; SGLang's
    offset says where a partial slot mapping starts. Both, on two chunks, with -1 slots."""
    plan = PLANS[module]
    ext = fitted(plan.paged, SCENARIOS["whole_blocks"]).ext
    full = block_table_mapping(24, random.Random(module), manager_extents(plan.paged, ext))
    full[9] = -1
    offset = 8
    sc = Scenario("offset", (8, 16), (16, 24), lambda r, e: full[offset:], offset=offset, ext=ext)
    partial = torch.tensor(full[offset:], device=device)
    connector = generated.get(plan.paged.name, plan.obj.name)(device=device)
    cache = make_cache(plan.paged, torch.float32, device, ext=ext)
    connector.bind(cache)
    objs = make_objects(connector, [8, 8], torch.float32, device, salt=9,
                        fmt=connector.format)
    expected = clone_tree(cache)
    connector_load(connector, objs, replace(sc, skip=3), cache, partial)
    reference_load(plan.paged, plan.obj, expected, objs, replace(sc, skip=3), full[offset:])
    assert same_bits(cache, expected)
    # skipping changes what is written: without it the reference writes more
    unskipped = make_cache(plan.paged, torch.float32, device, ext=ext)
    reference_load(plan.paged, plan.obj, unskipped, objs, replace(sc, skip=0), full[offset:])
    assert not same_bits(unskipped, expected)

    stored = make_objects(connector, [8, 8], torch.float32, device, salt=11)
    want = make_objects(connector, [8, 8], torch.float32, device, salt=11)
    connector_store(connector, stored, sc, cache, partial)
    reference_store(plan.paged, plan.obj, cache, want, sc, full[offset:])
    assert same_bits([obj_tensors(o) for o in stored], [obj_tensors(o) for o in want])


@pytest.mark.parametrize("module", [m for m in PLANS if PLANS[m].mode == "layerwise"])
def test_empty_work_keeps_yield_counts(module: str, device: str) -> None:
    """No tokens to move (all slots -1, or an empty chunk) still yields L + 1 / L + 2 times."""
    plan = PLANS[module]
    connector = generated.get(plan.paged.name, plan.obj.name)(device=device)
    cache = make_cache(plan.paged, torch.float32, device)
    connector.bind(cache)
    before = clone_tree(cache)
    mapping = torch.full((4,), -1, device=device)
    sc = Scenario("empty", (0, 4), (4, 4), lambda r, e: [-1] * 4)
    objs = make_objects(connector, [4, 0], torch.float32, device, salt=2, fmt=connector.format)
    assert connector_store(connector, objs, sc, cache, mapping) == EXT["L"] + 1
    assert connector_load(connector, objs, sc, cache, mapping) == EXT["L"] + 2
    assert same_bits(cache, before)


def test_capabilities_refuse_at_creation() -> None:
    assert generated.CAPABILITIES[("vllm_flash_attn_nhd", "KV_T2D", "layerwise", "xpu")]
    with pytest.raises(KVLayoutError, match="vllm_mla pairs with: kv_mla, kv_mla_layer"):
        generated.connector("vllm_mla", "kv_2ltd")
    with pytest.raises(KVLayoutError, match="not generated for device 'tpu'"):
        generated.connector("NHD", "kv_2ltd", device="tpu")
    assert generated.connector("NHD", "kv_2ltd").layout.name == "vllm_flash_attn_nhd"


def test_store_refuses_foreign_format_label(device: str) -> None:
    connector = generated.get("vllm_flash_attn_nhd", "kv_2ltd")(device=device)
    cache = make_cache(LIBRARY["vllm_flash_attn_nhd"], torch.float32, device)
    connector.bind(cache)
    obj = make_objects(connector, [4], torch.float32, device, salt=1, fmt=connector.format)[0]
    mla = type(connector.format)("KV_MLA_FMT", 6)
    obj.metadata.fmt = mla
    with pytest.raises(KVLayoutError, match="cannot store KV_2LTD into an object labelled KV_MLA_FMT"):
        connector.from_gpu(obj, 0, 4, kvcaches=cache, slot_mapping=torch.arange(4, device=device))
