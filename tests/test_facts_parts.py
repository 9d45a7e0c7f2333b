"""The format-2 built-in specs (parts, fields, packed objects) against kvgen.oracle.facts_planes.

The reference reads the same spec as the generator; these tests check each spec against what the
engines' and LMCache's sources say, and run every format-2 connector on caches and objects laid
out by the facts alone: each value (scales included) carries a code of its plane and coordinates,
so a scale stored for the wrong token, a field read at the wrong offset or a swapped plane fails.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

import pytest
import torch

from kvgen import generated
from kvgen.oracle.fact_table import FREE_DTYPE, ByteAddress, PartsFact, PlaneFact
from kvgen.oracle.facts import EngineGeometry
from kvgen.oracle.facts_planes import PACKED_FACTS, PARTS_FACTS, source_geometry, values
from kvgen.oracle.reference.planes import Leaf, read_leaf
from kvgen.oracle.scenarios import Scenario, connector_load, connector_store
from kvgen.runtime import MemoryObj

#: No two extents equal; per-part widths are C + 3 * index.
G = EngineGeometry(L=3, B=5, N=4, H=6, C=7, T=9)
LEVEL = {"L": lambda g: g.L, "KV": lambda g: 2}


def _level(axis: str, fact: PartsFact, g: EngineGeometry) -> int:
    return len(fact.parts) if axis == "P" else LEVEL[axis](g)


def _build(fact: PartsFact, g: EngineGeometry, make: Any) -> Any:
    """Containers as the source hands them over; make(path, part index) makes each leaf."""
    where = [axis for _, axis in fact.container]

    def level(depth: int, path: tuple[int, ...]) -> Any:
        if depth == len(fact.container):
            return make(path, path[where.index("P")] if "P" in where else 0)
        kind, axis = fact.container[depth]
        items = [level(depth + 1, (*path, i)) for i in range(_level(axis, fact, g))]
        return tuple(items) if kind == "tuple" else items

    return level(0, ())


def _leaf(tree: Any, path: tuple[int, ...]) -> Any:
    for i in path:
        tree = tree[i]
    return tree


def _dtype(fact: PartsFact, part: int) -> torch.dtype:
    return getattr(torch, fact.parts[part].dtype or FREE_DTYPE)


def _leaves(tree: Any, paths: list[tuple[int, ...]]) -> dict[tuple[int, ...], Leaf]:
    return {p: read_leaf(_leaf(tree, p)) for p in paths}


def _paths(fact: PartsFact, g: EngineGeometry) -> list[tuple[int, ...]]:
    import itertools

    return list(itertools.product(*(range(_level(a, fact, g)) for _, a in fact.container)))


def _code(plane: PlaneFact, *coords: int) -> str:
    return f"{plane.name}/" + "/".join(map(str, coords))


def code_bytes(label: str, size: int) -> bytes:
    """`size` bytes from a checksum of `label` (a value's plane and coordinates)."""
    word = zlib.crc32(label.encode()).to_bytes(4, "little")
    return (word * (size // 4 + 1))[:size]


@pytest.mark.parametrize("name", sorted(PARTS_FACTS))
def test_plane_facts_cover_every_byte_of_every_part_once(name: str) -> None:
    """The table itself: the values of a part's planes tile its tensors' bytes exactly, at the extents
    the source fixes (a page of 128 slots, say)."""
    fact = PARTS_FACTS[name]
    g = source_geometry(fact, G)
    owners: dict[tuple[tuple[int, ...], int], str] = {}
    cache = _build(fact, g, lambda path, part: torch.zeros(fact.parts[part].shape(g), dtype=_dtype(fact, part)))
    leaves = _leaves(cache, _paths(fact, g))
    for plane in fact.planes:
        size = fact.value_bytes(plane)
        for value in values(fact, plane, g):
            path, index, byte = plane.address(g, *value)
            at = leaves[path].offset(index, byte)
            for k in range(size):
                assert (path, at + k) not in owners, (plane.name, value, owners.get((path, at + k)))
                owners[(path, at + k)] = plane.name
    assert len(owners) == sum(len(leaf.data) for leaf in leaves.values())


# Each format-2 spec against its facts at three geometries: tests/test_facts.py::test_spec_matches_the_facts.


PAIRS = sorted(pair for pair in generated.CONNECTORS if pair[0] in PARTS_FACTS)


def test_every_format2_layout_has_connectors() -> None:
    assert {layout for layout, _ in PAIRS} == set(PARTS_FACTS)


def _fill(fact: PartsFact, g: EngineGeometry, tree: Any, tag: str, where: Any, pos_range: int,
          planes: list[PlaneFact]) -> None:
    """Write each value's code at `where(plane, layer, kv, pos, h, c)`."""
    paths: dict[tuple[int, ...], Leaf] = {}
    for plane in planes:
        size = fact.value_bytes(plane)
        for layer, kv, pos, h, c in values(fact, plane, _positions(g, pos_range)):
            path, index, byte = where(plane, layer, kv, pos, h, c)
            if path not in paths:
                paths[path] = read_leaf(_leaf(tree, path))
            leaf = paths[path]
            at = leaf.offset(index, byte)
            leaf.data[at:at + size] = code_bytes(f"{tag}/{_code(plane, layer, kv, pos, h, c)}", size)
    for leaf in paths.values():
        leaf.write_back()


def _positions(g: EngineGeometry, count: int) -> EngineGeometry:
    """A geometry whose B * N is `count` (values() walks slots as B * N)."""
    return EngineGeometry(L=g.L, B=1, N=count, H=g.H, C=g.C, T=g.T)


def _mismatches(fact: PartsFact, g: EngineGeometry, tree: Any, where: Any, want: Any, pos_range: int,
                planes: list[PlaneFact]) -> list[tuple]:
    leaves: dict[tuple[int, ...], Leaf] = {}
    bad = []
    for plane in planes:
        size = fact.value_bytes(plane)
        for value in values(fact, plane, _positions(g, pos_range)):
            path, index, byte = where(plane, *value)
            if path not in leaves:
                leaves[path] = read_leaf(_leaf(tree, path))
            leaf = leaves[path]
            at = leaf.offset(index, byte)
            expected = want(plane, *value, size)
            if bytes(leaf.data[at:at + size]) != expected:
                bad.append((plane.name, value))
    return bad


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}")
def test_format2_connector_moves_values_where_the_facts_say(pair: tuple[str, str]) -> None:
    """Store a cache filled through the facts (every value, scales included, coded by plane and
    coordinates): every object value must be where the object's facts put it. Then load an
    object filled through its facts into a zeroed cache: values of moved slots arrive where the
    cache's facts say, every other byte stays zero; per-layer scales arrive once a token moves."""
    layout, obj = pair
    fact, packed = PARTS_FACTS[layout], PACKED_FACTS[obj]
    g = source_geometry(fact, G)
    planes = list(fact.planes)
    rng = random.Random(f"{layout}/{obj}")
    order = rng.sample(range(g.B), g.B)
    mapping = [order[i // g.N] * g.N + i % g.N for i in range(g.T)]
    mapping[3] = -1  # a skipped token inside a block: its values must not move
    sc = Scenario("facts", (0,), (g.T,), lambda r, e: mapping)
    slot_mapping = torch.tensor(mapping)

    def cache_at(plane: PlaneFact, layer: int, kv: int, slot: int, h: int, c: int) -> ByteAddress:
        return plane.address(g, layer, kv, slot, h, c)

    def object_at(plane: PlaneFact, layer: int, kv: int, t: int, h: int, c: int) -> ByteAddress:
        return packed.address(g, fact, plane, layer, kv, t, h, c)

    cache = _build(fact, g, lambda path, part: torch.zeros(fact.parts[part].shape(g), dtype=_dtype(fact, part)))
    _fill(fact, g, cache, "cache", cache_at, g.B * g.N, planes)
    connector = generated.get(layout, obj)(device="cpu")
    connector.bind(cache)
    dtype = torch.uint8 if obj.startswith("kv_planes") else _dtype(fact, 0)
    assert tuple(connector.get_shape(g.T)) == packed.shape(g, fact)
    assert connector.get_dtype() == dtype

    def objects(fmt: Any) -> list[Any]:
        shape = packed.shape(g, fact)
        if packed.layerwise:
            return [[MemoryObj(torch.zeros(shape, dtype=dtype), fmt) for _ in range(g.L)]]
        return [MemoryObj(torch.zeros(shape, dtype=dtype), fmt)]

    stored = objects(None)
    connector_store(connector, stored, sc, cache, slot_mapping)
    tree = [o.tensor for o in stored[0]] if packed.layerwise else stored[0].tensor

    def stored_want(plane: PlaneFact, layer: int, kv: int, t: int, h: int, c: int, size: int) -> bytes:
        slot = mapping[t] if plane.slots else 0
        if plane.slots and slot < 0:
            return bytes(size)
        return code_bytes(f"cache/{_code(plane, layer, kv, slot, h, c)}", size)

    assert _mismatches(fact, g, tree if packed.layerwise else [tree], _wrap(object_at, packed.layerwise),
                       stored_want, g.T, planes)[:5] == []

    loaded = objects(connector.format)
    tree = [o.tensor for o in loaded[0]] if packed.layerwise else loaded[0].tensor
    _fill(fact, g, tree if packed.layerwise else [tree], "object", _wrap(object_at, packed.layerwise), g.T, planes)
    fresh = _build(fact, g, lambda path, part: torch.zeros(fact.parts[part].shape(g), dtype=_dtype(fact, part)))
    connector_load(connector, loaded, sc, fresh, slot_mapping)
    token_of = {slot: t for t, slot in enumerate(mapping) if slot >= 0}

    def loaded_want(plane: PlaneFact, layer: int, kv: int, slot: int, h: int, c: int, size: int) -> bytes:
        if not plane.slots:
            return code_bytes(f"object/{_code(plane, layer, kv, 0, h, c)}", size)
        t = token_of.get(slot)
        return bytes(size) if t is None else code_bytes(f"object/{_code(plane, layer, kv, t, h, c)}", size)

    assert _mismatches(fact, g, fresh, cache_at, loaded_want, g.B * g.N, planes)[:5] == []


def _wrap(where: Any, layerwise: bool) -> Any:
    """Object addresses as paths into a list: the per-layer list itself, or [the one tensor]."""
    def at(plane: PlaneFact, *value: int) -> ByteAddress:
        path, index, byte = where(plane, *value)
        return (path if layerwise else (0,)), index, byte
    return at


def test_packed_objects_hold_every_value_once() -> None:
    """A rows object's row is exactly the cache's planes; a regions object holds each value in
    bytes of its own (no two values share a byte)."""
    for name, fact in PARTS_FACTS.items():
        for packed in PACKED_FACTS.values():
            if not packed.fits(fact):
                continue
            shape = packed.shape(G, fact)
            item = 1 if packed.name.startswith("kv_planes") else fact.parts[0].item()
            owner: dict[tuple[tuple[int, ...], int], str] = {}
            for plane in fact.planes:
                for value in values(fact, plane, _positions(G, G.T)):
                    path, index, byte = packed.address(G, fact, plane, *value)
                    flat = 0
                    for i, n in zip(index, shape, strict=True):
                        assert 0 <= i < n, (name, packed.name, plane.name, value, index, shape)
                        flat = flat * n + i
                    for k in range(fact.value_bytes(plane)):
                        key = (path, flat * item + byte + k)
                        assert key not in owner, (name, packed.name, plane.name, value, owner[key])
                        owner[key] = plane.name
            if packed.name.startswith("kv_mla_rows"):  # no padding in a row: every byte is a value's
                assert len(owner) == G.L * G.T * shape[-1] * item
