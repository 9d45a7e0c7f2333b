"""kvgen.remote's fast descriptor arithmetic against the straightforward one it replaced: a read's
descriptors merged from a tiled template (runs.descriptors) are the whole index grid's merge
(runs.descriptors_flat), row for row, and merged_count is their number; and a plan made with the
fast path is the plan the flat path makes: the same strategy and reasons, the same reads (staged
reads compared by leaf and offset of their own staging caches, which each plan allocates anew)
and the same staging permutes; a staged chunk's read cut from the whole read's cut (runs.parts)
is the read cut from the chunk's own pairs."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from kvgen import remote
from kvgen.remote import runs
from kvgen.runtime.binding import leaves
from kvgen.tools.pd import run as pd_run
from kvgen.tools.pd.request import Request, WorkerSide
from tests.remote_harness import Case
from tests.test_remote_properties import cases

#: The planner's module (kvgen.remote.plan is also the name of its function there).
plan_module = importlib.import_module("kvgen.remote.plan")


def _flat_count(cut: runs.Layout) -> int:
    return len(runs.descriptors_flat(cut)[0])


def _parts_anew(cut: runs.Layout, reads: list[tuple[np.ndarray, np.ndarray]], bounds: Any) -> list[runs.Layout]:
    """A staged plan's chunks each cut from its own pairs, as the planner cut them before runs.parts."""
    return [runs.layout(cut.src, cut.dst, pairs, cut.heads) for pairs in reads]


def _checked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """runs.descriptors checked against the flat grid on every read a plan cuts; the reads seen."""
    seen: list[int] = []
    fast, count = runs.descriptors, runs.merged_count

    def descriptors(cut: runs.Layout) -> tuple[np.ndarray, np.ndarray]:
        got, want = fast(cut), runs.descriptors_flat(cut)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
        assert count(cut) == len(want[0])
        seen.append(len(want[0]))
        return got

    def merged_count(cut: runs.Layout) -> int:
        assert count(cut) == _flat_count(cut)
        return count(cut)

    monkeypatch.setattr(runs, "descriptors", descriptors)
    monkeypatch.setattr(runs, "merged_count", merged_count)
    return seen


def _staged_places(descs: np.ndarray, caches: Any) -> list[tuple[int, int, int]]:
    """Each descriptor as (leaf of `caches`, offset in it, bytes): a staging cache's addresses differ
    from plan to plan, its layout does not."""
    bases = [t.data_ptr() for t in leaves(caches)]
    span = max(t.untyped_storage().nbytes() for t in leaves(caches))
    out = []
    for addr, n, _ in descs.tolist():
        k = next(k for k, b in enumerate(bases) if b <= addr < b + span)
        out.append((k, addr - bases[k], n))
    return out


def _same_plans(fast: remote.Plan, flat: remote.Plan) -> None:
    assert (fast.strategy, fast.why, fast.chunks) == (flat.strategy, flat.why, flat.chunks)
    assert len(fast.reads) == len(flat.reads) and len(fast.staging) == len(flat.staging)
    for a, b in zip(fast.staging, flat.staging, strict=True):
        assert (a.pair, a.src_heads, a.dst_heads, a.chunk) == (b.pair, b.src_heads, b.dst_heads, b.chunk)
        assert torch.equal(a.src_slots, b.src_slots) and torch.equal(a.dst_slots, b.dst_slots)
    for k, (a, b) in enumerate(zip(fast.reads, flat.reads, strict=True)):
        assert (a.src_rank, a.chunk) == (b.src_rank, b.chunk)
        np.testing.assert_array_equal(a.src_descs, b.src_descs)
        if fast.strategy == "direct":
            np.testing.assert_array_equal(a.dst_descs, b.dst_descs)
        else:
            # A staged plan's read k fills staging k (both in chunk order, one per route).
            assert _staged_places(a.dst_descs, fast.staging[k].caches) == \
                _staged_places(b.dst_descs, flat.staging[k].caches)


def _both(monkeypatch: pytest.MonkeyPatch, srcs: Any, dst: Any, s: Any, t: Any,
          strategy: str | None) -> tuple[remote.Plan, remote.Plan, list[int]]:
    """The plan by the fast path (every read checked against the flat grid), then by the flat path alone."""
    with monkeypatch.context() as m:
        seen = _checked(m)
        fast = remote.plan(srcs, dst, s, t, strategy=strategy)
    with monkeypatch.context() as m:
        m.setattr(runs, "descriptors", runs.descriptors_flat)
        m.setattr(runs, "merged_count", _flat_count)
        m.setattr(plan_module, "parts", _parts_anew)
        flat = remote.plan(srcs, dst, s, t, strategy=strategy)
    return fast, flat, seen


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_fast_descriptors_make_the_flat_grids_plan_for_random_pairs(
        drawn: tuple[Case, list[int], list[int], str]) -> None:
    case, s_slots, d_slots, strategy = drawn
    srcs, dst = case.caches()
    sd, dd = case.describe(srcs, dst)
    with pytest.MonkeyPatch.context() as mp:
        for forced in (strategy, None):
            fast, flat, seen = _both(mp, sd, dd, torch.tensor(s_slots), torch.tensor(d_slots), forced)
            _same_plans(fast, flat)
            assert len(seen) >= len(fast.reads)  # every read's descriptors went through the check


SIDES = {"nhd": "vllm_flash_attn_nhd", "hnd": "vllm_flash_attn_hnd", "sglang_mla": "sglang_mla",
         "vllm_mla": "vllm_mla", "hicache_mla": "hicache_mla_page_first_direct"}


@pytest.mark.parametrize("pair", [("nhd", "nhd"), ("nhd", "hnd"), ("hnd", "nhd"), ("sglang_mla", "vllm_mla"),
                                  ("vllm_mla", "hicache_mla")])
@pytest.mark.parametrize("shape", [(1, 1, 16, 16), (2, 4, 16, 32), (4, 2, 16, 16)])
@pytest.mark.parametrize("layers", [1, 3])
def test_fast_descriptors_make_the_flat_grids_plan_for_pd_requests(
        monkeypatch: pytest.MonkeyPatch, pair: tuple[str, str], shape: tuple[int, int, int, int], layers: int) -> None:
    """`kvgen pd`'s requests (random block tables), smaller: 1024 tokens (64 source blocks: a
    staged plan reads and permutes them in 4 chunks) of 1 layer (a paged MLA source: no dim
    outside the tokens, so the last run of one chunk can continue into the next chunk's first,
    where consecutive blocks meet at a chunk edge) or 3."""
    req = Request(WorkerSide(SIDES[pair[0]], shape[0], shape[2]), WorkerSide(SIDES[pair[1]], shape[1], shape[3]),
                  1024, layers=layers)
    trees = [remote.empty(req.src.layout, pd_run.extents(req, req.src), torch.bfloat16) for _ in range(req.src.tp)]
    srcs = [remote.describe(tr, req.src.layout, tp_rank=r, tp_size=req.src.tp, num_kv_heads=req.heads)
            for r, tr in enumerate(trees)]
    mine = remote.empty(req.dst.layout, pd_run.extents(req, req.dst), torch.bfloat16)
    dst = remote.describe(mine, req.dst.layout, tp_rank=req.dst.tp - 1, tp_size=req.dst.tp, num_kv_heads=req.heads)
    s, t = pd_run.slots(req, req.src, 1), pd_run.slots(req, req.dst, 2)
    t[::7] = -1  # skipped tokens break the runs of consecutive slots
    for strategy in (None, "direct", "staged"):
        fast, flat, _ = _both(monkeypatch, srcs, dst, s, t, strategy)
        _same_plans(fast, flat)  # chunks' descriptors are made together (runs.chunked_descriptors): compared here
        assert fast.count == sum(len(r.dst_descs) for r in fast.reads) > 0
        if fast.strategy == "staged":
            assert len(fast.chunks) == plan_module.STAGE_CHUNKS
