"""The format-2 built-in specs (parts, fields, packed objects) against kvgen.oracle.facts.planes.

The reference reads the same spec as the generator; these tests check each spec against what the
engines' and LMCache's sources say, and run every format-2 connector on caches and objects laid
out by the facts alone: each value (scales included) carries a code of its plane and coordinates,
so a scale stored for the wrong token, a field read at the wrong offset or a swapped plane fails.
"""

from __future__ import annotations

import functools
import random
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvgen import generated
from kvgen.oracle.agreement import grids
from kvgen.oracle.facts.layouts import EngineGeometry
from kvgen.oracle.facts.planes import PACKED_FACTS, PARTS_FACTS, PackedFact, source_geometry, value_sizes
from kvgen.oracle.facts.table import FREE_DTYPE, ByteAddress, PartsFact, PlaneFact
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


# The facts are integer arithmetic that also takes index tensors (kvgen.oracle.agreement): every
# value of a plane is addressed in one call, on its coordinates flattened in values() order.

def _coords(sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """(layer, kv, pos, h, c) of every value of a plane, each flattened in values() order."""
    return [grid.expand(sizes).reshape(-1) for grid in grids(sizes)]


def _value(sizes: tuple[int, ...], row: int) -> tuple[int, ...]:
    """The coordinates of the value at `row` of values() order."""
    out = []
    for n in reversed(sizes):
        row, i = divmod(row, n)
        out.append(i)
    return tuple(reversed(out))


def _located(where: Any, coords: list[torch.Tensor]) -> Iterator[tuple[tuple[int, ...], torch.Tensor, Any, Any]]:
    """`where(*coords)` grouped by container path: (path, rows of those values, index, byte)."""
    count = coords[0].numel()
    path, index, byte = where(*coords)

    def flat(x: Any) -> torch.Tensor:
        return torch.as_tensor(x).expand(count)

    columns = [flat(p) for p in path]
    if all(bool((c == c[0]).all()) for c in columns):  # one container (the common case): nothing to group
        yield tuple(int(c[0]) for c in columns), torch.arange(count), tuple(flat(i) for i in index), flat(byte)
        return
    key = torch.zeros(count, dtype=torch.int64)
    for column in columns:  # one number per path (a 1-D unique is far cheaper than unique rows)
        key = key * (int(column.max()) + 1) + column
    inverse = torch.unique(key, return_inverse=True)[1]
    for j in range(int(inverse.max()) + 1):
        rows = (inverse == j).nonzero().reshape(-1)
        yield tuple(int(c[rows[0]]) for c in columns), rows, tuple(flat(i)[rows] for i in index), flat(byte)[rows]


def _spans(starts: torch.Tensor, size: int) -> torch.Tensor:
    """The bytes [start, start + size) of each value, one row per value."""
    return starts[:, None] + torch.arange(size)


MASK = 0xFFFFFFFF


def _mix(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors of 32-bit words (every bit depends on every bit)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK
    return h ^ (h >> 16)


def code_bytes(label: str, coords: list[torch.Tensor], size: int) -> torch.Tensor:
    """`size` bytes per value: a 32-bit hash of `label` (where the value comes from and its plane)
    and its coordinates, repeated; one row per value."""
    word = torch.full_like(coords[0], zlib.crc32(label.encode()))
    for x in coords:
        word = _mix(word ^ x)
    return ((word[:, None] >> (8 * (torch.arange(size) % 4))) & 0xFF).to(torch.uint8)


def _claims(fact: PartsFact, located: Any, byte_of: Any) -> dict[tuple[int, ...], list]:
    """Per container path, (bytes, plane index, rows) of every value of every plane of `fact`;
    located(plane) gives _located's groups and byte_of(plane, path, rows, index, byte) each
    value's first byte."""
    claims: dict[tuple[int, ...], list] = {}
    for k, plane in enumerate(fact.planes):
        size = fact.value_bytes(plane)
        for path, rows, index, byte in located(plane):
            spans = _spans(byte_of(plane, path, rows, index, byte), size)
            claims.setdefault(path, []).append((spans.reshape(-1), k, rows.repeat_interleave(size)))
    return claims


def _shared_byte(fact: PartsFact, sizes: Any, claims: list) -> tuple | None:
    """The first byte two values claim, as (byte, (plane, value), (plane, value)), or None."""
    at = torch.cat([b for b, _, _ in claims])
    plane = torch.cat([torch.full_like(b, k) for b, k, _ in claims])
    row = torch.cat([r for _, _, r in claims])
    order = torch.argsort(at, stable=True)
    same = (at[order][1:] == at[order][:-1]).nonzero().reshape(-1)
    if not same.numel():
        return None
    i, j = order[same[0]].item(), order[same[0] + 1].item()
    named = [(fact.planes[plane[x]].name, _value(sizes(fact.planes[plane[x]]), int(row[x]))) for x in (i, j)]
    return at[i].item(), *named


@pytest.mark.parametrize("name", sorted(PARTS_FACTS))
def test_plane_facts_cover_every_byte_of_every_part_once(name: str) -> None:
    """The table itself: the values of a part's planes tile its tensors' bytes exactly."""
    fact = PARTS_FACTS[name]
    g = source_geometry(fact, G)  # with the extents the source fixes (a page of 128 slots, say)
    cache = _build(fact, g, lambda path, part: torch.zeros(fact.parts[part].shape(g), dtype=_dtype(fact, part)))
    leaves = _leaves(cache, _paths(fact, g))

    def sizes(plane: PlaneFact) -> tuple[int, ...]:
        return value_sizes(plane, g)

    def located(plane: PlaneFact) -> Any:
        return _located(functools.partial(plane.address, g), _coords(sizes(plane)))

    def byte_of(plane: PlaneFact, path: tuple[int, ...], rows: torch.Tensor, index: Any, byte: Any) -> torch.Tensor:
        return leaves[path].offset(index, byte)

    claims = _claims(fact, located, byte_of)
    for path, owned in claims.items():
        assert _shared_byte(fact, sizes, owned) is None, path
    assert sum(b.numel() for owned in claims.values() for b, _, _ in owned) == sum(
        len(leaf.data) for leaf in leaves.values())


# Each format-2 spec against its facts at three geometries: tests/test_facts.py::test_spec_matches_the_facts.


PAIRS = sorted(pair for pair in generated.CONNECTORS if pair[0] in PARTS_FACTS)


def test_every_format2_layout_has_connectors() -> None:
    assert {layout for layout, _ in PAIRS} == set(PARTS_FACTS)


def _fill(fact: PartsFact, gv: EngineGeometry, tree: Any, tag: str, where: Any) -> None:
    """Write each value's code (of `tag`, its plane and coordinates) at `where(plane, layer, kv,
    pos, h, c)`, for the values of every plane on the geometry `gv`."""
    leaves: dict[tuple[int, ...], Leaf] = {}
    for plane in fact.planes:
        size = fact.value_bytes(plane)
        coords = _coords(value_sizes(plane, gv))
        codes = code_bytes(f"{tag}/{plane.name}", coords, size)
        for path, rows, index, byte in _located(functools.partial(where, plane), coords):
            if path not in leaves:
                leaves[path] = read_leaf(_leaf(tree, path))
            leaf = leaves[path]
            torch.frombuffer(leaf.data, dtype=torch.uint8)[_spans(leaf.offset(index, byte), size)] = codes[rows]
    for leaf in leaves.values():
        leaf.write_back()


def _positions(g: EngineGeometry, count: int) -> EngineGeometry:
    """A geometry whose B * N is `count` (values() walks slots as B * N)."""
    return EngineGeometry(L=g.L, B=1, N=count, H=g.H, C=g.C, T=g.T)


def _mismatches(fact: PartsFact, gv: EngineGeometry, tree: Any, where: Any, want: Any) -> list[tuple]:
    """(plane, value) of every value of `gv` whose bytes at `where` are not `want(plane, coords, size)`."""
    leaves: dict[tuple[int, ...], Leaf] = {}
    bad = []
    for plane in fact.planes:
        size = fact.value_bytes(plane)
        sizes = value_sizes(plane, gv)
        coords = _coords(sizes)
        expected = want(plane, coords, size)
        for path, rows, index, byte in _located(functools.partial(where, plane), coords):
            if path not in leaves:
                leaves[path] = read_leaf(_leaf(tree, path))
            leaf = leaves[path]
            got = torch.frombuffer(leaf.data, dtype=torch.uint8)[_spans(leaf.offset(index, byte), size)]
            wrong = rows[(got != expected[rows]).any(1)]
            bad += [(plane.name, _value(sizes, r)) for r in sorted(wrong.tolist())]
    return bad


def _where_moved(moved: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The codes of values that moved, zero bytes for the others."""
    return torch.where(moved[:, None], codes, 0)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}")
def test_format2_connector_moves_values_where_the_facts_say(pair: tuple[str, str]) -> None:
    """Store a cache filled through the facts (every value, scales included, coded by plane and
    coordinates): every object value must be where the object's facts put it. Then load an
    object filled through its facts into a zeroed cache: values of moved slots arrive where the
    cache's facts say, every other byte stays zero; per-layer scales arrive once a token moves."""
    layout, obj = pair
    fact, packed = PARTS_FACTS[layout], PACKED_FACTS[obj]
    g = source_geometry(fact, G)
    rng = random.Random(f"{layout}/{obj}")
    order = rng.sample(range(g.B), g.B)
    mapping = [order[i // g.N] * g.N + i % g.N for i in range(g.T)]
    mapping[3] = -1  # a skipped token inside a block: its values must not move
    sc = Scenario("facts", (0,), (g.T,), lambda r, e: mapping)
    slot_mapping = torch.tensor(mapping)
    slots, tokens = _positions(g, g.B * g.N), _positions(g, g.T)

    def cache_at(plane: PlaneFact, layer: Any, kv: Any, slot: Any, h: Any, c: Any) -> ByteAddress:
        return plane.address(g, layer, kv, slot, h, c)

    def object_at(plane: PlaneFact, layer: Any, kv: Any, t: Any, h: Any, c: Any) -> ByteAddress:
        return packed.address(g, fact, plane, layer, kv, t, h, c)

    cache = _build(fact, g, lambda path, part: torch.zeros(fact.parts[part].shape(g), dtype=_dtype(fact, part)))
    _fill(fact, slots, cache, "cache", cache_at)
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

    def stored_want(plane: PlaneFact, coords: list[torch.Tensor], size: int) -> torch.Tensor:
        layer, kv, t, h, c = coords
        slot = slot_mapping[t] if plane.slots else torch.zeros_like(t)
        return _where_moved(slot >= 0, code_bytes(f"cache/{plane.name}", [layer, kv, slot.clamp(min=0), h, c], size))

    assert _mismatches(fact, tokens, tree if packed.layerwise else [tree], _wrap(object_at, packed.layerwise),
                       stored_want)[:5] == []

    loaded = objects(connector.format)
    tree = [o.tensor for o in loaded[0]] if packed.layerwise else loaded[0].tensor
    _fill(fact, tokens, tree if packed.layerwise else [tree], "object", _wrap(object_at, packed.layerwise))
    fresh = _build(fact, g, lambda path, part: torch.zeros(fact.parts[part].shape(g), dtype=_dtype(fact, part)))
    connector_load(connector, loaded, sc, fresh, slot_mapping)
    token_of = torch.full((g.B * g.N,), -1)
    moved = slot_mapping >= 0
    token_of[slot_mapping[moved]] = torch.arange(g.T)[moved]

    def loaded_want(plane: PlaneFact, coords: list[torch.Tensor], size: int) -> torch.Tensor:
        layer, kv, slot, h, c = coords
        t = token_of[slot] if plane.slots else torch.zeros_like(slot)
        return _where_moved(t >= 0, code_bytes(f"object/{plane.name}", [layer, kv, t.clamp(min=0), h, c], size))

    assert _mismatches(fact, slots, fresh, cache_at, loaded_want)[:5] == []


def _wrap(where: Any, layerwise: bool) -> Any:
    """Object addresses as paths into a list: the per-layer list itself, or [the one tensor]."""
    def at(plane: PlaneFact, *value: Any) -> ByteAddress:
        path, index, byte = where(plane, *value)
        return (path if layerwise else (0,)), index, byte
    return at


def _packed_claims(fact: PartsFact, packed: PackedFact, name: str) -> tuple[dict, Any]:
    """_claims of every value of `fact`'s planes in `packed` (bytes counted in the object's
    elements, flattened row-major), each element index checked against the object's shape."""
    shape = packed.shape(G, fact)
    item = 1 if packed.name.startswith("kv_planes") else fact.parts[0].item()

    def sizes(plane: PlaneFact) -> tuple[int, ...]:
        return value_sizes(plane, _positions(G, G.T))

    def located(plane: PlaneFact) -> Any:
        return _located(functools.partial(packed.address, G, fact, plane), _coords(sizes(plane)))

    def byte_of(plane: PlaneFact, path: tuple[int, ...], rows: torch.Tensor, index: Any, byte: Any) -> torch.Tensor:
        flat = torch.zeros_like(rows)
        for i, n in zip(index, shape, strict=True):
            outside = rows[(i < 0) | (i >= n)]
            assert not outside.numel(), (name, packed.name, plane.name, _value(sizes(plane), int(outside[0])), shape)
            flat = flat * n + i
        return flat * item + byte

    return _claims(fact, located, byte_of), sizes


def test_packed_objects_hold_every_value_once() -> None:
    """A rows object's row is exactly the cache's planes; a regions object holds each value in
    bytes of its own (no two values share a byte)."""
    for name, fact in PARTS_FACTS.items():
        for packed in PACKED_FACTS.values():
            if not packed.fits(fact):
                continue
            claims, sizes = _packed_claims(fact, packed, name)
            for path, owned in claims.items():
                assert _shared_byte(fact, sizes, owned) is None, (name, packed.name, path)
            if packed.name.startswith("kv_mla_rows"):  # no padding in a row: every byte is a value's
                shape = packed.shape(G, fact)
                item = fact.parts[0].item()
                assert sum(b.numel() for owned in claims.values() for b, _, _ in owned) == G.L * G.T * shape[-1] * item
