"""kvgen.remote's plans against vLLM 0.33's own offload planning (vllm/v1/kv_offload/base.py
CopyRun / CanonicalPageMapping, derived by vLLM's derive_canonical_mappings): a TP rank's
worker pages read into the parallelism-free canonical page. kvgen's direct plan for the same
move must write the same bytes as vLLM's runs and take no more contiguous pieces than vLLM's
fragments (at TP 1, one whole page per layer and block, as vLLM's single run)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from harness import vllm_module

vllm_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping")

from kvgen import remote  # noqa: E402
from kvgen.oracle.facts import vllm as facts_vllm  # noqa: E402
from tests.test_engine_vllm_offload import (  # noqa: E402
    BLOCKS,
    CANONICAL,
    FAMILY,
    C,
    L,
    N,
    engine_cache,
    fill,
    full,
    mappings,
    memory_order,
    slots,
    vllm_rows,
)

HEADS = 4


def _rank(layout: str, tp: int, rank: int) -> tuple[list[torch.Tensor], remote.CacheDescription, dict, list[str], dict]:
    kv, config, names = engine_cache(layout, full(heads=HEADS // tp))
    fill(kv, names, first_head=rank * HEADS // tp, heads_total=HEADS)
    cache = memory_order(kv, names, layout, False)
    d = remote.describe(cache, facts_vllm.SPEC_OF[layout], tp_rank=rank, tp_size=tp, num_kv_heads=HEADS)
    return cache, d, kv, names, mappings(kv, config, HEADS, tp, rank)


@pytest.mark.parametrize("tp, rank", [(1, 0), (2, 0), (2, 1)])
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_a_tp_rank_reads_into_the_canonical_page_as_vllm_maps_it(layout: str, tp: int, rank: int) -> None:
    ranks = [_rank(layout, tp, r) for r in range(tp)]
    _, _, kv, names, maps = ranks[rank]
    page = maps[names[0]].canonical_page_size_bytes
    want = torch.zeros(len(BLOCKS), L * page, dtype=torch.int8)
    vllm_rows(kv, names, maps, want)  # this rank's share of each canonical row, by vLLM's runs
    host = CANONICAL[FAMILY[layout]]
    ext = {"L": L, "KV": 2, "H": HEADS, "C": C, "N": N, "B": len(BLOCKS), "S": len(BLOCKS) * N}
    rows = remote.empty(host, ext, torch.float32)
    rows.zero_()
    dst = remote.describe(rows, host, tp_rank=0, tp_size=1, num_kv_heads=HEADS)
    p = remote.plan([r[1] for r in ranks], dst, slots(BLOCKS), slots(list(range(len(BLOCKS)))), strategy="direct")
    (read,) = [r for r in p.reads if r.src_rank == rank]
    for (sa, n, _), (da, _, _) in zip(read.src_descs.tolist(), read.dst_descs.tolist(), strict=True):
        ctypes.memmove(da, sa, n)
    assert torch.equal(rows.view(torch.int8).reshape(len(BLOCKS), -1), want)
    fragments = sum(run.num_fragments for n in names for run in maps[n].runs) * len(BLOCKS)
    assert len(read.dst_descs) <= fragments
