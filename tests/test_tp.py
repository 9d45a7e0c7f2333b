"""kvgen.tp: the resharding plan covers every destination head exactly once, each from a
source rank holding that same global head (property test over num_kv_heads, src_tp, dst_tp);
replicated heads are read from one rank only and spread over the replicas; MLA needs one
source per destination; sizes the engines cannot shard are refused. Importable without torch."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgen.errors import KVLayoutError
from kvgen.tp import HeadRanges, Route, explain, local_heads, plan, rank_heads


@st.composite
def shardings(draw: st.DrawFn) -> tuple[int, int, int]:
    """A head count and two TP sizes the engines accept: divisors or multiples of it."""
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32, 64]))
    sizes = sorted({d for d in range(1, heads + 1) if heads % d == 0} | {heads * k for k in (2, 4, 8)})
    return heads, draw(st.sampled_from(sizes)), draw(st.sampled_from(sizes))


@settings(max_examples=300, deadline=None)
@given(shardings())
def test_every_destination_head_is_written_exactly_once_from_a_holder(case: tuple[int, int, int]) -> None:
    heads, src_tp, dst_tp = case
    routes = plan(heads, src_tp, dst_tp)
    written: Counter[tuple[int, int]] = Counter()
    for r in routes:
        assert r.count > 0 and r.dst_heads[1] - r.dst_heads[0] == r.count
        s0, s1 = rank_heads(heads, src_tp, r.src_rank)
        d0, d1 = rank_heads(heads, dst_tp, r.dst_rank)
        assert 0 <= r.src_heads[0] and s0 + r.src_heads[1] <= s1, r  # inside the source rank's heads
        assert 0 <= r.dst_heads[0] and d0 + r.dst_heads[1] <= d1, r
        for j in range(r.count):  # the same global head on both sides
            assert s0 + r.src_heads[0] + j == d0 + r.dst_heads[0] + j
            written[(r.dst_rank, r.dst_heads[0] + j)] += 1
    every = {(d, j) for d in range(dst_tp) for j in range(local_heads(heads, dst_tp))}
    assert set(written) == every and set(written.values()) == {1}


def test_a_routes_heads_are_what_a_transfer_call_takes() -> None:
    # 8 heads, TP 2 -> 4: destination rank 3 holds global heads 6..7, local (2, 4) of source rank 1
    route = plan(8, 2, 4)[3]
    assert route == Route(1, 3, (2, 4), (0, 2))
    assert route.heads == HeadRanges(src_heads=(2, 4), dst_heads=(0, 2))
    assert explain(8, 2, 4)[-1].endswith("heads=route.heads) on each route")


@settings(max_examples=200, deadline=None)
@given(shardings())
def test_ranks_hold_equal_runs_that_cover_every_head(case: tuple[int, int, int]) -> None:
    heads, tp_size, _ = case
    held = [rank_heads(heads, tp_size, r) for r in range(tp_size)]
    assert {b - a for a, b in held} == {local_heads(heads, tp_size)}
    covered = Counter(h for a, b in held for h in range(a, b))
    assert set(covered) == set(range(heads))
    assert set(covered.values()) == {max(1, tp_size // heads)}  # replicated when tp > heads


@settings(max_examples=100, deadline=None)
@given(shardings())
def test_replicated_source_heads_spread_over_their_replicas(case: tuple[int, int, int]) -> None:
    heads, src_tp, dst_tp = case
    if src_tp <= heads or dst_tp < src_tp:
        return
    readers = Counter(r.src_rank for r in plan(heads, src_tp, dst_tp))
    assert max(readers.values()) - min(readers.values()) <= 1 and len(readers) == src_tp


def test_known_plans() -> None:
    assert plan(8, 2, 4) == (Route(0, 0, (0, 2), (0, 2)), Route(0, 1, (2, 4), (0, 2)),
                             Route(1, 2, (0, 2), (0, 2)), Route(1, 3, (2, 4), (0, 2)))
    assert plan(8, 4, 2) == (Route(0, 0, (0, 2), (0, 2)), Route(1, 0, (0, 2), (2, 4)),
                             Route(2, 1, (0, 2), (0, 2)), Route(3, 1, (0, 2), (2, 4)))
    assert plan(8, 1, 1) == (Route(0, 0, (0, 8), (0, 8)),)
    # 2 heads over 8 ranks: rank r holds head r // 4; each destination reads one replica.
    assert plan(2, 8, 2) == (Route(0, 0, (0, 1), (0, 1)), Route(4, 1, (0, 1), (0, 1)))
    assert [r.src_rank for r in plan(2, 8, 8)] == list(range(8))
    assert plan(2, 2, 4) == (Route(0, 0, (0, 1), (0, 1)), Route(0, 1, (0, 1), (0, 1)),
                             Route(1, 2, (0, 1), (0, 1)), Route(1, 3, (0, 1), (0, 1)))


def test_mla_reads_the_latent_once_per_destination() -> None:
    assert plan(1, 2, 4, mla=True) == tuple(Route(d % 2, d, (0, 1), (0, 1)) for d in range(4))
    assert plan(128, 8, 1, mla=True) == (Route(0, 0, (0, 1), (0, 1)),)


@pytest.mark.parametrize("args,word", [
    ((8, 3, 2), "source tp 3 does not divide num_kv_heads 8"),
    ((8, 2, 12), "destination tp 12 is larger than num_kv_heads 8 but not a multiple"),
    ((0, 1, 1), "num_kv_heads must be a positive integer"),
    ((8, 0, 1), "src_tp must be a positive integer"),
    ((8, 2, True), "dst_tp must be a positive integer"),
])
def test_unshardable_sizes_are_refused(args: tuple[int, int, int], word: str) -> None:
    with pytest.raises(KVLayoutError, match=word):
        plan(*args)


def test_rank_outside_the_group() -> None:
    with pytest.raises(KVLayoutError, match="rank 4 is not one of the 4 ranks"):
        rank_heads(8, 4, 4)


def test_importable_without_torch() -> None:
    code = ("import sys\nfrom kvgen.tp import plan\nplan(8, 2, 8)\n"
            "assert not [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
