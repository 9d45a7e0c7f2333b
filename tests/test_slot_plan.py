"""plan_chunk: how a chunk's slot mapping splits into the block path (whole in-order blocks)
and the token path, and the one-pass C reading of the slots (csrc/kvcopy.c: kvgen_slots) that
stands in for the tensor ops on the CPU: both must say the same of every mapping."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgen.runtime import aliasing, native, slots
from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.slots import Chunk, plan_chunk

pytestmark = pytest.mark.skipif(native.library() is None, reason="needs the compiled kernel: " +
                                str(native.unavailable()))


@dataclass(frozen=True)
class Cache:
    S: int
    N: int | None


def values(x: object) -> object:
    """A chunk field as plain values (tensors as lists, so two plans compare with ==)."""
    return x.tolist() if isinstance(x, torch.Tensor) else x


def fields(ck: Chunk) -> dict[str, object]:
    return {name: values(getattr(ck, name)) for name in Chunk.__dataclass_fields__}


def both_ways(mapping: list[int], start: int, end: int, cache: Cache, *, skip: int = 0) -> tuple[Chunk, Chunk]:
    """The plan made with the C reading of the slots, and the one made with tensor ops only."""
    t = torch.tensor(mapping, dtype=torch.int64)
    native_plan = plan_chunk(t, start, end, cache, skip=skip)
    lib = native.library()
    try:
        native._state["lib"] = None
        torch_plan = plan_chunk(t, start, end, cache, skip=skip)
    finally:
        native._state["lib"] = lib
    return native_plan, torch_plan


# (what the mapping is, mapping, blocks of N=4 in a cache of 64 slots, expected block ids, block path
# (first token, tokens), token path positions: None for every token, [] for none)
CASES = [
    ("two whole blocks in order", [8, 9, 10, 11, 12, 13, 14, 15], slice(2, 4), (0, 8), []),
    ("two whole blocks out of order", [12, 13, 14, 15, 0, 1, 2, 3], [3, 0], (0, 8), []),
    ("a partial block each side", [6, 7, 8, 9, 10, 11, 12], slice(2, 3), (2, 4), [0, 1, 6]),
    ("no whole block", [5, 6, 7], None, (0, 0), None),
    ("a block not in slot order", [3, 2, 1, 0], None, (0, 0), None),
    ("a skipped token inside", [0, 1, -1, 3, 4, 5, 6, 7], None, (0, 0), [0, 1, 3, 4, 5, 6, 7]),
]


@pytest.mark.parametrize(("what", "mapping", "blocks", "span", "tokens"), CASES, ids=[c[0] for c in CASES])
def test_a_chunk_moves_whole_in_order_blocks_on_the_block_path(what: str, mapping: list[int], blocks: object,
                                                               span: tuple[int, int], tokens: list[int] | None
                                                               ) -> None:
    native_plan, torch_plan = both_ways(mapping, 0, len(mapping), Cache(64, 4))
    assert fields(native_plan) == fields(torch_plan)
    assert values(native_plan.block_ids) == blocks
    assert (native_plan.block_start, native_plan.block_tokens) == span
    if tokens == []:  # no token takes the token path: its fields are all None (Chunk)
        assert (native_plan.tok, native_plan.slots, native_plan.blk, native_plan.off) == (None,) * 4
    else:
        assert values(native_plan.tok) == tokens
    moved = [s for s in mapping if s >= 0]
    on_path = [mapping[i] for i in range(span[0], span[0] + span[1])]
    rest = values(native_plan.slots)
    assert sorted(on_path + (rest if isinstance(rest, list) else [])) == sorted(moved)


def test_a_skipped_prefix_never_moves() -> None:
    native_plan, torch_plan = both_ways([0, 1, 2, 3, 4, 5, 6, 7], 0, 8, Cache(64, 4), skip=3)
    assert fields(native_plan) == fields(torch_plan)
    assert native_plan.moved == 5
    assert (native_plan.block_start, native_plan.block_tokens, native_plan.block_ids) == (4, 4, slice(1, 2))
    assert values(native_plan.tok) == [3]


def test_a_folded_slot_axis_with_consecutive_slots_is_one_slice() -> None:
    native_plan, torch_plan = both_ways([5, 6, 7, 8], 0, 4, Cache(64, None))
    assert fields(native_plan) == fields(torch_plan)
    assert native_plan.slots == slice(5, 9) and native_plan.block_ids is None


def test_a_slot_past_the_cache_is_refused_whichever_path_reads_it() -> None:
    for lib in (native.library(), None):
        saved = native.library()
        native._state["lib"] = lib
        try:
            with pytest.raises(KVLayoutError, match="slot 64 is outside the cache"):
                plan_chunk(torch.tensor([0, 64]), 0, 2, Cache(64, 4))
        finally:
            native._state["lib"] = saved


@st.composite
def mappings(draw: st.DrawFn) -> tuple[list[int], int, int, int]:
    """A block size, a mapping of whole blocks in a drawn order with some tokens unmapped, and a chunk of it."""
    n = draw(st.sampled_from([1, 2, 4, 16]))
    blocks = draw(st.permutations(range(8)))[:draw(st.integers(1, 8))]
    mapping = [b * n + j for b in blocks for j in range(n)]
    for i in draw(st.lists(st.integers(0, len(mapping) - 1), max_size=3)):
        mapping[i] = -1
    if draw(st.booleans()):  # a token written out of slot order
        i, j = draw(st.integers(0, len(mapping) - 1)), draw(st.integers(0, len(mapping) - 1))
        mapping[i], mapping[j] = mapping[j], mapping[i]
    start = draw(st.integers(0, len(mapping)))
    end = draw(st.integers(start, len(mapping)))
    return mapping, start, end, n


@settings(max_examples=300, deadline=None)
@given(mappings(), st.integers(0, 5))
def test_the_c_reading_of_the_slots_plans_what_the_tensor_ops_plan(drawn: tuple[list[int], int, int, int],
                                                                   skip: int) -> None:
    mapping, start, end, n = drawn
    skip = min(skip, end - start)
    native_plan, torch_plan = both_ways(mapping, start, end, Cache(8 * n, n), skip=skip)
    assert fields(native_plan) == fields(torch_plan)
    t = torch.tensor(mapping[start:end], dtype=torch.int64)
    if t.numel():
        assert comparable(slots._native_facts(native.library(), t, skip, n)) == comparable(
            slots._torch_facts(t, skip, n))


def comparable(facts: slots.SlotFacts) -> tuple[object, ...]:
    """`facts` as plain values (a run's block ids as a list)."""
    run = facts.run and (facts.run[0], facts.run[1], values(facts.run[2]))
    return facts.low, facts.high, facts.moved, facts.first, facts.one_run, run


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-2, 12), max_size=24))
def test_the_c_search_for_a_slot_written_twice_finds_what_the_sort_finds(mapping: list[int]) -> None:
    t = torch.tensor(mapping, dtype=torch.int64)
    lib = native.library()
    found = aliasing._repeated_slot(t)
    try:
        native._state["lib"] = None
        assert aliasing._repeated_slot(t) == found
    finally:
        native._state["lib"] = lib
    twice = sorted(s for s in set(mapping) if s >= 0 and mapping.count(s) > 1)
    assert found == (twice[0] if twice else None)
