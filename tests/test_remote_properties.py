"""Properties of kvgen.remote.plan over random layouts, TP sizes, block sizes and slots: the
descriptors write every destination byte they own exactly once, read only inside the leaves of
the source rank the TP routes name, and the plan leaves what the reference leaves."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgen import remote
from kvgen.oracle.scenarios import same_bits
from kvgen.oracle.scenarios.transfers import SRC_EXT
from tests.remote_harness import PART_WIDTHS, SPLIT_LAYOUTS, Case, PartsCase, run_by_memmove

PAIRS = [("vllm_flash_attn_nhd", "vllm_flash_attn_hnd"), ("vllm_flash_attn_hnd", "vllm_flash_attn_nhd"),
         ("sglang_mha", "vllm_flash_attn_nhd"), ("vllm_kv_tuple", "hicache_page_first"),
         ("vllm_flash_attn_nhd", "hicache_layer_first"), ("dynamo_universal", "vllm_kv_tuple"),
         ("sglang_mla", "vllm_mla"), ("vllm_mla", "hicache_mla_page_first_direct"),
         ("vllm_lhbnc", "vllm_canonical_lbhnc"), ("sglang_mha", "hicache_page_unified_grouped"),
         ("hicache_page_unified_grouped", "sglang_mha_hnd")]
#: TP sizes for 4 KV heads: split, and replicated (8 ranks); where a side holds the heads in groups
#: of two, the sizes that keep each rank's heads whole groups.
SIZES = [1, 2, 4, 8]
GROUPED_SIZES = [1, 2]
SLOTS = 48  # every cache here has 48 slots, whatever its block size


def _counts(descs: torch.Tensor, leaves: tuple[int, ...], span: int) -> list[torch.Tensor]:
    """How often each byte of each leaf is written by `descs`; every descriptor inside one leaf."""
    return _region_counts(descs, [(base, span) for base in leaves])


def _region_counts(descs: torch.Tensor, regions: list[tuple[int, int]]) -> list[torch.Tensor]:
    """How often each byte of each (address, bytes) region is written; every descriptor inside one."""
    counts = [torch.zeros(span, dtype=torch.int32) for _, span in regions]
    for addr, n, _ in descs.tolist():
        k = next((k for k, (base, span) in enumerate(regions) if base <= addr < base + span), None)
        assert k is not None, f"descriptor at {addr:#x} is in no leaf"
        start = addr - regions[k][0]
        assert start + n <= regions[k][1], f"descriptor at {addr:#x} of {n} B runs off its leaf"
        counts[k][start:start + n] += 1
    return counts


@st.composite
def cases(draw: st.DrawFn) -> tuple[Case, list[int], list[int], str]:
    src, dst = draw(st.sampled_from(PAIRS))
    s_n, d_n = draw(st.sampled_from([2, 4, 8])), draw(st.sampled_from([2, 4, 8, 16]))
    sizes = GROUPED_SIZES if SPLIT_LAYOUTS & {src, dst} else SIZES
    s_tp, d_tp = draw(st.sampled_from(sizes)), draw(st.sampled_from(sizes))
    rank = draw(st.integers(0, d_tp - 1))
    case = Case(src, dst, {**SRC_EXT, "N": s_n, "B": SLOTS // s_n}, {**SRC_EXT, "N": d_n, "B": SLOTS // d_n},
                s_tp, d_tp, rank, 4)
    tokens = draw(st.integers(1, 24))
    s_slots = draw(st.lists(st.integers(-1, SLOTS - 1), min_size=tokens, max_size=tokens))
    d_slots = draw(st.lists(st.integers(0, SLOTS - 1), min_size=tokens, max_size=tokens, unique=True))
    d_slots = [d if draw(st.integers(0, 9)) else -1 for d in d_slots]
    return case, s_slots, d_slots, draw(st.sampled_from(["direct", "staged"]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_descriptors_cover_their_bytes_once_from_the_owning_rank(drawn: tuple[Case, list[int], list[int], str]) -> None:
    case, s_slots, d_slots, strategy = drawn
    srcs, dst = case.caches()
    sd, dd = case.describe(srcs, dst)
    p = remote.plan(sd, dd, torch.tensor(s_slots), torch.tensor(d_slots), strategy=strategy)
    moved = sum(1 for s, d in zip(s_slots, d_slots, strict=True) if s >= 0 and d >= 0)
    heads = (dd.extent("H") if not dd.mla else 1)
    # Every destination element this rank owns and the tokens reach arrives once: direct into
    # the cache, staged through the permute (whose reads fill each staging byte once).
    for read in p.reads:  # (a source slot may feed several destination slots: no count here)
        _counts(read.src_descs, sd[read.src_rank].leaves, sd[read.src_rank].span)
    if strategy == "direct":
        counts = _counts(p.dst_descs, dd.leaves, dd.span)
        assert all(int(c.max()) <= 1 for c in counts)
        assert sum(int(c.sum()) for c in counts) == moved * dd.extent("L") * dd.extent("KV") * heads * \
            dd.extent("C") * dd.itemsize
    else:
        for read, staging in zip(p.reads, p.staging, strict=True):
            here = remote.describe(staging.caches, sd[read.src_rank].spec, tp_rank=read.src_rank, tp_size=case.src_tp,
                                   num_kv_heads=4)
            assert all(bool((c == 1).all()) for c in _counts(read.dst_descs, here.leaves, here.span))
    run_by_memmove(p, dst)
    assert same_bits(dst, case.expected(srcs, case.caches()[1], s_slots, d_slots))


@st.composite
def multipart_cases(draw: st.DrawFn) -> tuple[PartsCase, list[int], list[int]]:
    s_tp, d_tp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    case = PartsCase(draw(st.sampled_from(sorted(PART_WIDTHS))), s_tp, d_tp, draw(st.integers(0, d_tp - 1)),
                     blocks=(draw(st.sampled_from([2, 4, 8])), draw(st.sampled_from([2, 4, 16]))))
    tokens = draw(st.integers(1, 12))
    s_slots = draw(st.lists(st.integers(-1, case.slots - 1), min_size=tokens, max_size=tokens))
    d_slots = draw(st.lists(st.integers(0, case.slots - 1), min_size=tokens, max_size=tokens, unique=True))
    return case, s_slots, [d if draw(st.integers(0, 9)) else -1 for d in d_slots]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(multipart_cases())
def test_every_byte_of_every_part_once_from_the_owning_rank(drawn: tuple[PartsCase, list[int], list[int]]) -> None:
    """A cache of several parts (K and V of different widths; MLA latent and rope): the reads
    write each byte of every part the tokens reach exactly once and read only inside the leaves
    of the source rank each read names; the codes that arrive say which rank they came from."""
    case, s_slots, d_slots = drawn
    srcs, dst = case.caches()
    sd, dd = case.describe(srcs, dst)
    p = remote.plan(sd, dd, torch.tensor(s_slots), torch.tensor(d_slots))
    for read in p.reads:
        _region_counts(read.src_descs, [(a, n) for a, n, _ in sd[read.src_rank].regions()])
    counts = _region_counts(p.dst_descs, [(a, n) for a, n, _ in dd.regions()])
    assert all(int(c.max()) <= 1 for c in counts)
    moved = sum(1 for s, d in zip(s_slots, d_slots, strict=True) if s >= 0 and d >= 0)
    per_token = sum(q.extent("L") * q.extent("KV") * q.extent("H") * q.extent("C") * q.itemsize for q in dd.parts)
    assert sum(int(c.sum()) for c in counts) == moved * per_token
    run_by_memmove(p, dst)
    assert same_bits(dst, case.expected(s_slots, d_slots))
