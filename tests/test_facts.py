"""Every built-in spec against the independent facts of kvgen.oracle.facts.

The reference reads the same spec as the generator; these tests compare each spec with what the
engines' and LMCache's sources say (shape, containers, where each element lives), and run every
generated connector on caches and objects laid out by the facts alone.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from harness import builtin_library

from kvgen import generated
from kvgen.oracle import reference
from kvgen.oracle.facts.groups import GROUPS_FACTS
from kvgen.oracle.facts.layouts import (
    FACTS,
    EngineGeometry,
    Fact,
    disagreement,
    elements,
    extents,
    level_size,
    positions,
)
from kvgen.oracle.facts.planes import PACKED_FACTS, PARTS_FACTS
from kvgen.oracle.scenarios import Scenario, connector_load, connector_store
from kvgen.runtime import MemoryObj

LIBRARY = builtin_library()
SPECS = {s.name: s for s in LIBRARY.specs}

#: No two extents equal (KV is 2), so a swapped pair of axes changes a shape or an address.
GEOMETRIES = (
    EngineGeometry(L=3, B=5, N=4, H=6, C=7, T=9),
    EngineGeometry(L=5, B=3, N=7, H=4, C=6, T=11),
    EngineGeometry(L=4, B=6, N=3, H=5, C=8, T=10),
)


def test_every_builtin_spec_has_a_fact_and_every_fact_a_spec() -> None:
    # Format-2 specs (parts, fields, packed objects) are in kvgen.oracle.facts.planes.
    every = [*FACTS, *PARTS_FACTS, *PACKED_FACTS, *GROUPS_FACTS]
    assert sorted(SPECS) == sorted(every), (
        f"specs without facts: {sorted(set(SPECS) - set(every))}; "
        f"facts without specs: {sorted(set(every) - set(SPECS))}"
    )


@pytest.mark.parametrize("g", GEOMETRIES, ids=str)
def test_geometries_keep_every_extent_apart(g: EngineGeometry) -> None:
    sizes = [g.L, 2, g.B, g.N, g.H, g.C, g.T]
    assert len(set(sizes)) == len(sizes)
    assert g.T <= g.B * g.N


def _leaf_paths(fact: Fact, g: EngineGeometry) -> list[tuple[int, ...]]:
    ranges = [range(level_size(axis, g)) for _, axis in fact.container]
    return [tuple(p) for p in itertools.product(*ranges)]


@pytest.mark.parametrize("name", sorted(FACTS))
def test_fact_addresses_cover_their_shape_once(name: str) -> None:
    """The table itself: every element has its own place, and every place holds an element."""
    fact = FACTS[name]
    for g in GEOMETRIES:
        shape, paths = fact.shape(g), set(_leaf_paths(fact, g))
        seen = set()
        for e in elements(fact, g):
            path, index = fact.address(g, *e)
            assert len(index) == len(shape) and all(0 <= i < n for i, n in zip(index, shape, strict=True)), (e, index)
            assert path in paths
            seen.add((path, index))
        assert len(seen) == len(paths) * math.prod(shape)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_matches_the_facts(name: str) -> None:
    """Shape, sizes, LMCache format and the address of every element, at each geometry."""
    for g in GEOMETRIES:
        assert disagreement(SPECS[name], g) is None


@pytest.mark.parametrize("name", sorted(FACTS))
def test_spec_containers_and_shape_are_the_engines(name: str) -> None:
    """kvgen's nest and leaf_shape give the containers and tensor shape the source hands over."""
    spec, fact = SPECS[name], FACTS[name]
    for g in GEOMETRIES:
        ext = extents(g)
        assert reference.layouts.leaf_shape(spec, ext) == fact.shape(g)
        tree = reference.layouts.nest(spec, ext, lambda path: ("leaf", path))

        def walk(node: Any, depth: int, path: tuple[int, ...], g: EngineGeometry = g) -> None:
            if depth == len(fact.container):
                assert node == ("leaf", path)
                return
            kind, axis = fact.container[depth]
            expected_type = {"list": list, "tuple": tuple, "seq": (list, tuple)}[kind]
            assert isinstance(node, expected_type), (name, depth, type(node))
            assert len(node) == level_size(axis, g)
            for i, child in enumerate(node):
                walk(child, depth + 1, (*path, i))

        walk(tree, 0, ())


# -- end to end: generated connectors on caches and objects laid out by the facts --------------

G = GEOMETRIES[0]


def _build(fact: Fact, g: EngineGeometry, make: Callable[[tuple[int, ...]], torch.Tensor]) -> Any:
    """Containers as the source hands them over ("seq" as a list, as LMCache's SGLang adapter)."""

    def level(depth: int, path: tuple[int, ...]) -> Any:
        if depth == len(fact.container):
            return make(path)
        kind, axis = fact.container[depth]
        items = [level(depth + 1, (*path, i)) for i in range(level_size(axis, g))]
        return tuple(items) if kind == "tuple" else items

    return level(0, ())


def _leaf(tree: Any, path: tuple[int, ...]) -> torch.Tensor:
    for i in path:
        tree = tree[i]
    return tree


def _by_leaf(fact: Fact, g: EngineGeometry, value: Callable[..., float]) -> dict[tuple[int, ...], tuple[list, list]]:
    groups: dict[tuple[int, ...], tuple[list, list]] = defaultdict(lambda: ([], []))
    for e in elements(fact, g):
        path, index = fact.address(g, *e)
        groups[path][0].append(index)
        groups[path][1].append(value(*e))
    return groups


def _columns(indices: list[tuple[int, ...]]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.tensor(col) for col in zip(*indices, strict=True))


def _write(fact: Fact, g: EngineGeometry, tree: Any, value: Callable[..., float]) -> None:
    for path, (indices, values) in _by_leaf(fact, g, value).items():
        _leaf(tree, path)[_columns(indices)] = torch.tensor(values, dtype=torch.float32)


def _mismatches(fact: Fact, g: EngineGeometry, tree: Any, value: Callable[..., float]) -> list[tuple]:
    bad = []
    for path, (indices, values) in _by_leaf(fact, g, value).items():
        got = _leaf(tree, path)[_columns(indices)].tolist()
        bad += [(path, i, w, x) for i, w, x in zip(indices, values, got, strict=True) if w != x]
    return bad


def _cache_code(fact: Fact, g: EngineGeometry) -> Callable[..., float]:
    slots = positions(fact, g)
    return lambda layer, kv, slot, h, c: float(((((layer * 2 + kv) * slots + slot) * g.H + h) * g.C + c) + 1)


def _object_code(g: EngineGeometry) -> Callable[..., float]:
    return lambda layer, kv, t, h, c: float(100000 + (((layer * 2 + kv) * g.T + t) * g.H + h) * g.C + c)


PAIRS = sorted(pair for pair in generated.CONNECTORS if set(pair) <= set(FACTS))


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}")
def test_generated_connector_moves_elements_where_the_facts_say(pair: tuple[str, str]) -> None:
    """Store a cache filled through the fact addresses; every object element must be where
    LMCache's format puts it. Then load an object filled through its facts into a fresh cache."""
    layout, obj = pair
    paged, memory = FACTS[layout], FACTS[obj]
    pool = paged.pool  # a pooled cache: each manager slot is `pool` states, each token `pool` object rows
    G = dataclasses.replace(GEOMETRIES[0], T=GEOMETRIES[0].T // pool * pool)  # noqa: N806 (the module's name)
    rng = random.Random(f"{layout}/{obj}")
    order = rng.sample(range(G.B), G.B)
    per_block = G.N // pool  # the manager's slots of a block
    manager = [order[i // per_block] * per_block + i % per_block for i in range(G.T // pool)]
    mapping = [s * pool + j for s in manager for j in range(pool)]  # each object row's state
    sc = Scenario("facts", (0,), (G.T // pool,), lambda r, e: manager)
    slot_mapping = torch.tensor(manager, dtype=torch.long)

    cache = _build(paged, G, lambda path: torch.zeros(paged.shape(G), dtype=torch.float32))
    cache_code = _cache_code(paged, G)
    _write(paged, G, cache, cache_code)
    connector = generated.get(layout, obj)(device="cpu")
    connector.bind(cache)
    assert tuple(connector.get_shape(G.T // pool)) == memory.shape(G)

    def objects(fmt: Any) -> Any:
        made = _build(memory, G, lambda path: MemoryObj(torch.full(memory.shape(G), -1.0), fmt))
        return [made]

    stored = objects(None)
    connector_store(connector, stored, sc, cache, slot_mapping)
    tensors = _build(memory, G, lambda path: _leaf(stored[0], path).tensor)
    want = lambda layer, kv, t, h, c: cache_code(layer, kv, mapping[t], h, c)  # noqa: E731
    assert _mismatches(memory, G, tensors, want)[:5] == []

    loaded = objects(connector.format)
    tensors = _build(memory, G, lambda path: _leaf(loaded[0], path).tensor)
    object_code = _object_code(G)
    _write(memory, G, tensors, object_code)
    fresh = _build(paged, G, lambda path: torch.zeros(paged.shape(G), dtype=torch.float32))
    connector_load(connector, loaded, sc, fresh, slot_mapping)
    token_of = {slot: t for t, slot in enumerate(mapping)}

    def expected(layer: int, kv: int, slot: int, h: int, c: int) -> float:
        t = token_of.get(slot)
        return 0.0 if t is None else object_code(layer, kv, t, h, c)

    assert _mismatches(paged, G, fresh, expected)[:5] == []


@pytest.mark.parametrize("g", GEOMETRIES, ids=str)
def test_vllm_033_specs_say_the_order_vllm_hands_a_layer_over_in(g: EngineGeometry) -> None:
    """`given` against vLLM's sources (kvgen.oracle.facts.vllm): the memory-order leaf, read in the
    spec's given order, is vLLM's logical [B, H, N, C] view (MLA: [B, 1, N, C])."""
    from kvgen.oracle.facts import vllm as facts_vllm

    ext = extents(g)
    for name in [*facts_vllm.SPEC_OF.values(), facts_vllm.MLA_SPEC]:
        spec = SPECS[name]
        memory = reference.layouts.leaf_shape(spec, ext)
        handed = [memory[spec.dims.index(d)] for d in spec.given]
        want = [g.B, 1, g.N, g.C] if name == facts_vllm.MLA_SPEC else [g.B, g.H, g.N, 2 * g.C]
        assert handed == want, f"{name}: given {spec.given} hands over {handed}, vLLM hands over {want}"
