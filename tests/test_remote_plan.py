"""kvgen.remote.plan, carried out by plain memmove (no transport): element by element against
the independent transfer reference, on coordinate-coded caches of every rank."""

from __future__ import annotations

import importlib
import random
import re

import pytest
import torch

from kvgen import generated, remote
from kvgen.oracle.scenarios import same_bits
from kvgen.oracle.scenarios.transfers import SCENARIOS, SRC_EXT
from kvgen.runtime.errors import KVLayoutError
from tests.remote_harness import REMOTE_PAIRS, SPLIT_LAYOUTS, Case, moved_right, run_by_memmove

PAIRS = REMOTE_PAIRS
#: Partial blocks at both ends with -1 on either side; a larger destination block size; a
#: smaller one; random slots.
MAPPINGS = ("partial_minus1", "larger_dst_blocks", "smaller_dst_blocks", "random_slots")


def _case(src: str, dst: str, scenario: str, src_tp: int = 1, dst_tp: int = 1, rank: int = 0,
          heads: int | None = None) -> tuple[Case, list[int], list[int]]:
    """A case of `heads` KV heads: by default 2, and 4 (two groups of two) where a side groups them."""
    sc = SCENARIOS[scenario]
    heads = heads or (4 if SPLIT_LAYOUTS & {src, dst} else 2)
    case = Case(src, dst, dict(sc.src_ext), dict(sc.dst_ext), src_tp, dst_tp, rank, heads)
    s, d = sc.mapping(random.Random(f"{src}/{dst}/{scenario}/{rank}"), sc.src_ext, sc.dst_ext)
    return case, s, d


@pytest.mark.parametrize("strategy", ["direct", "staged"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
def test_every_builtin_pair_moves_like_the_reference(pair: tuple[str, str], strategy: str) -> None:
    wrong = []
    for scenario in MAPPINGS[:2]:
        ok, used = moved_right(*_case(*pair, scenario), strategy)
        assert used == strategy
        if not ok:
            wrong.append(scenario)
    assert wrong == []


#: (source, destination) of the built-in pairs with SGLang's page_unified pool in head groups.
GROUPED_PAIRS = [p for p in PAIRS if SPLIT_LAYOUTS & set(p)]


def test_a_cache_in_head_groups_is_described_by_its_groups() -> None:
    """SGLang's page_unified pool in head groups ([pages, groups, L, 2, page, heads per group, C]):
    each axis's byte stride is its dim's, H is described as its groups and a head's place in one,
    and the description crosses the wire unchanged."""
    assert SPLIT_LAYOUTS == {"hicache_page_unified_grouped"} and len(GROUPED_PAIRS) == 4
    pool = torch.zeros(4, 3, 5, 2, 16, 2, 8)  # 3 groups of 2 heads, 5 layers
    d = remote.describe(pool, "hicache_page_unified_grouped", tp_rank=0, tp_size=1)
    item = pool.element_size()
    assert {a: d.stride(a) for a in ("B", "H/", "L", "KV", "N", "H%", "C")} == \
        {a: pool.stride(i) * item for i, a in enumerate(("B", "H/", "L", "KV", "N", "H%", "C"))}
    assert (d.extent("H"), d.group, d.grouped, d.mla, d.num_kv_heads) == (6, 2, True, False, 6)
    assert remote.CacheDescription.from_bytes(d.to_bytes()) == d


@pytest.mark.parametrize("sizes", [(1, 2), (2, 1), (2, 2)], ids=lambda s: f"tp{s[0]}->tp{s[1]}")
@pytest.mark.parametrize("pair", GROUPED_PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
def test_head_groups_move_between_tp_sizes(pair: tuple[str, str], sizes: tuple[int, int]) -> None:
    """4 KV heads in groups of two on the grouped side: every rank's heads are whole groups."""
    for rank in range(sizes[1]):
        for strategy in ("direct", "staged"):
            assert moved_right(*_case(*pair, "larger_dst_blocks", *sizes, rank, heads=4), strategy)[0], \
                (rank, strategy)


@pytest.mark.parametrize("strategy", ["direct", "staged", None])
@pytest.mark.parametrize(("src", "dst", "sizes", "said"), [
    ("hicache_page_unified_grouped", "sglang_mha", (1, 4), "source rank 0's head 1 of route 0 -> 1"),
    ("sglang_mha", "hicache_page_unified_grouped", (4, 2), "destination rank 1's head 0 of route 2 -> 1"),
], ids=["grouped-source", "grouped-destination"])
def test_a_read_that_cuts_a_head_group_is_refused_before_anything_is_allocated(
        src: str, dst: str, sizes: tuple[int, int], said: str, strategy: str | None) -> None:
    """Two groups of two heads on a rank, read by (or from) ranks of one head each: each read
    would cut a group. Refused while planning whatever the strategy (a staged plan reads into
    staging in the source's own layout, where no group is seen), naming the rank and its heads."""
    case, s, d = _case(src, dst, "partial_minus1", *sizes, 1, heads=4)
    srcs, dst_cache = case.caches()
    sd, dd = case.describe(srcs, dst_cache)
    with pytest.raises(KVLayoutError, match=re.escape(f"hicache_page_unified_grouped: {said} cut its groups of 2 "
                                                      "heads; a cache in head groups moves whole groups")):
        remote.plan(sd, dd, torch.tensor(s), torch.tensor(d), strategy=strategy)


def test_a_cache_in_head_groups_is_made_with_its_group_size_and_fingerprinted_by_it() -> None:
    ext = {"L": 2, "KV": 2, "H": 6, "C": 8, "B": 4, "N": 16, "S": 64}
    with pytest.raises(KVLayoutError, match="its extents need 'H%', the heads of a group, dividing H=6"):
        remote.empty("hicache_page_unified_grouped", {**ext, "H%": 4}, torch.float32)
    with pytest.raises(KVLayoutError, match="dividing H=6 \\(got None\\)"):
        remote.empty("hicache_page_unified_grouped", ext, torch.float32)
    two, one = (remote.empty("hicache_page_unified_grouped", {**ext, "H%": g}, torch.float32) for g in (2, 1))
    assert (two.shape[1], two.shape[5], one.shape[1], one.shape[5]) == (3, 2, 6, 1)
    prints = {remote.describe(c, "hicache_page_unified_grouped", tp_rank=0, tp_size=1).fingerprint for c in (two, one)}
    assert len(prints) == 2  # a stored object of groups of two is not read back as groups of one


def test_two_caches_grouped_unlike_are_refused() -> None:
    """Groups of two against groups of one: a head would land in another place of its group."""
    two = remote.describe(torch.zeros(4, 2, 3, 2, 16, 2, 8), "hicache_page_unified_grouped", tp_rank=0, tp_size=1)
    one = remote.describe(torch.zeros(4, 4, 3, 2, 16, 1, 8), "hicache_page_unified_grouped", tp_rank=0, tp_size=1)
    with pytest.raises(KVLayoutError, match="heads per group 2 vs 1"):
        remote.check_pair(two, one)


@pytest.mark.parametrize("scenario", MAPPINGS)
@pytest.mark.parametrize("strategy", ["direct", "staged", None])
def test_block_sizes_and_slots(scenario: str, strategy: str | None) -> None:
    for pair in (("vllm_flash_attn_hnd", "vllm_flash_attn_nhd"), ("sglang_mha", "vllm_flash_attn_nhd"),
                 ("vllm_flash_attn_nhd", "hicache_page_first")):
        assert moved_right(*_case(*pair, scenario), strategy)[0], pair


#: (source TP, destination TP) with 4 KV heads: split, merged, replicated on either side.
TP_SIZES = [(1, 2), (2, 4), (4, 2), (2, 1), (2, 8), (8, 2), (4, 4)]
#: Per-layer NHD into HND, (K, V) tuples into a page-first host pool, MLA (one source each).
TP_PAIRS = [("vllm_flash_attn_nhd", "vllm_flash_attn_hnd"), ("vllm_kv_tuple", "hicache_page_first"),
            ("sglang_mla", "vllm_mla")]


@pytest.mark.parametrize("sizes", TP_SIZES, ids=lambda s: f"tp{s[0]}->tp{s[1]}")
@pytest.mark.parametrize("pair", TP_PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
def test_every_destination_rank_reads_its_heads_from_their_owners(pair: tuple[str, str],
                                                                  sizes: tuple[int, int]) -> None:
    for rank in range(sizes[1]):
        for strategy in ("direct", "staged"):
            case, s, d = _case(*pair, "partial_minus1", *sizes, rank, heads=4)
            assert moved_right(case, s, d, strategy)[0], (rank, strategy)


def _nhd_ranks(blocks: int = 16) -> tuple[Case, list, object]:
    case = Case("vllm_flash_attn_nhd", "vllm_flash_attn_nhd", {**SRC_EXT, "B": blocks}, {**SRC_EXT, "B": blocks},
                1, 1, 0, 2)
    return case, *case.caches()


def test_whole_consecutive_blocks_are_one_descriptor_per_layer_and_plane() -> None:
    case, srcs, dst = _nhd_ranks()
    sd, dd = case.describe(srcs, dst)
    n = SRC_EXT["N"]
    p = remote.plan(sd, dd, torch.arange(2 * n, 6 * n), torch.arange(8 * n, 12 * n), strategy="direct")
    # L leaves x K/V, each a run of 4 whole blocks: coalesced over N, H, C and the blocks.
    assert p.count == SRC_EXT["L"] * 2
    assert set(p.dst_descs[:, 1].tolist()) == {4 * n * SRC_EXT["H"] * SRC_EXT["C"] * 4}
    assert p.bytes == 4 * n * SRC_EXT["L"] * 2 * SRC_EXT["H"] * SRC_EXT["C"] * 4


def test_the_cost_model_stages_short_runs_and_reads_long_ones_directly() -> None:
    slow_descriptors = remote.Costs(per_descriptor=1e-3, wire=1e9, local=1e12, per_permute=0.0)
    case = Case("vllm_flash_attn_hnd", "vllm_flash_attn_nhd", dict(SRC_EXT), dict(SRC_EXT), 1, 1, 0, 2)
    srcs, dst = case.caches()
    sd, dd = case.describe(srcs, dst)
    slots = torch.arange(0, 16)
    staged = remote.plan(sd, dd, slots, slots, cost=slow_descriptors)
    assert staged.strategy == "staged" and staged.staging and "direct" in staged.why and "staged" in staged.why
    slow_permute = remote.Costs(per_descriptor=0.0, wire=1e9, local=1.0, per_permute=1.0)
    direct = remote.plan(sd, dd, slots, slots, cost=slow_permute)
    assert direct.strategy == "direct" and not direct.staging
    forced = remote.plan(sd, dd, slots, slots, strategy="direct", cost=slow_descriptors)
    assert forced.strategy == "direct" and forced.why == "forced" and not forced.staging


def test_staged_reads_are_costed_as_merged_however_many_they_are_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """A staged read copies the source's own layout, so whole blocks merge into a few long
    descriptors: its estimate counts them after merging even past the bound (EXACT) where a
    direct read's count before merging stands in, which would make long direct plans look cheaper."""
    remote_plan = importlib.import_module("kvgen.remote.plan")  # the module: `remote.plan` is its function
    per_descriptor = remote.Costs(per_descriptor=1e-3, wire=1e12, local=1e12, per_permute=0.0)
    case = Case("vllm_flash_attn_hnd", "vllm_flash_attn_nhd", dict(SRC_EXT), dict(SRC_EXT), 1, 1, 0, 2)
    srcs, dst = case.caches()
    sd, dd = case.describe(srcs, dst)
    slots = torch.arange(0, 16)
    exact = remote.plan(sd, dd, slots, slots, cost=per_descriptor)
    monkeypatch.setattr(remote_plan, "EXACT", 1)  # every count above the bound: direct's stays an upper bound
    bounded = remote.plan(sd, dd, slots, slots, cost=per_descriptor)
    assert exact.strategy == bounded.strategy == "staged"
    staged_words = bounded.why.split("staged ")[1]
    assert not staged_words.startswith("up to") and "direct up to" in bounded.why
    assert staged_words.split(" descriptors")[0] == exact.why.split("staged ")[1].split(" descriptors")[0]


def test_costs_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGEN_REMOTE_COSTS", '{"per_descriptor": 1e-5}')
    assert remote.costs() == remote.Costs(per_descriptor=1e-5)
    monkeypatch.setenv("KVGEN_REMOTE_COSTS", '{"per_desc": 1}')
    with pytest.raises(KVLayoutError, match="per_desc"):
        remote.costs()


def test_skipped_tokens_plan_nothing() -> None:
    case, srcs, dst = _nhd_ranks()
    sd, dd = case.describe(srcs, dst)
    p = remote.plan(sd, dd, torch.tensor([-1, 3]), torch.tensor([5, -1]))
    assert p.count == 0 and p.bytes == 0 and not p.staging
    run_by_memmove(p, dst)


def test_bad_slots_and_strategies_are_refused_naming_them() -> None:
    case, srcs, dst = _nhd_ranks()
    sd, dd = case.describe(srcs, dst)
    s_all = sd[0].extent("S")
    for src_slots, dst_slots, words in (
            (torch.tensor([s_all]), torch.tensor([0]), f"slot {s_all} is outside"),
            (torch.tensor([0, 1]), torch.tensor([4, 4]), "slot 4 is written by more than one token"),
            (torch.tensor([0, 1]), torch.tensor([4]), "one slot per token"),
            (torch.tensor([0.0]), torch.tensor([4]), "signed integers")):
        with pytest.raises(KVLayoutError, match=words):
            remote.plan(sd, dd, src_slots, dst_slots)
    with pytest.raises(KVLayoutError, match="strategy must be one of"):
        remote.plan(sd, dd, torch.tensor([0]), torch.tensor([0]), strategy="fast")


def test_a_missing_source_rank_is_named() -> None:
    case = Case("vllm_flash_attn_nhd", "vllm_flash_attn_hnd", dict(SRC_EXT), dict(SRC_EXT), 2, 1, 0, 4)
    srcs, dst = case.caches()
    sd, dd = case.describe(srcs, dst)
    with pytest.raises(KVLayoutError, match=r"no description of rank\(s\) \[1\]"):
        remote.plan(sd[0], dd, torch.tensor([0]), torch.tensor([0]))


def test_staging_without_a_generated_transfer_is_refused() -> None:
    case = Case("vllm_flashinfer_nhd", "vllm_flashinfer_nhd", dict(SRC_EXT), dict(SRC_EXT), 1, 1, 0, 2)
    assert ("vllm_flashinfer_nhd", "vllm_flashinfer_nhd") not in generated.TRANSFERS
    srcs, dst = case.caches()
    sd, dd = case.describe(srcs, dst)
    with pytest.raises(KVLayoutError, match="needs a generated transfer"):
        remote.plan(sd, dd, torch.tensor([0]), torch.tensor([0]), strategy="staged")
    p = remote.plan(sd, dd, torch.tensor([0]), torch.tensor([0]))
    assert p.strategy == "direct" and "no generated transfer" in p.why


def test_finish_refuses_another_cache() -> None:
    case, srcs, dst = _nhd_ranks()
    sd, dd = case.describe(srcs, dst)
    p = remote.plan(sd, dd, torch.arange(4), torch.arange(4), strategy="staged")
    other = case.caches()[1]
    with pytest.raises(KVLayoutError, match="not the cache this plan was made for"):
        p.finish(other)


def test_a_2048_token_request_of_32_layers_plans_every_byte() -> None:
    """(The planner's speed is measured by `kvgen bench --remote`, not here.)"""
    L, H, C, N = 32, 8, 128, 16
    blocks = 2048 // N
    src = [torch.empty(2, blocks, N, H, C, dtype=torch.bfloat16) for _ in range(L)]
    dst = [torch.empty(2, blocks, H, N, C, dtype=torch.bfloat16) for _ in range(L)]
    sd = remote.describe(src, "vllm_flash_attn_nhd", tp_rank=0, tp_size=1)
    dd = remote.describe(dst, "vllm_flash_attn_hnd", tp_rank=0, tp_size=1)
    slots = torch.randperm(blocks)[:, None] * N + torch.arange(N)
    p = remote.plan(sd, dd, slots.flatten(), torch.arange(2048), strategy="direct")
    assert p.bytes == 2048 * L * 2 * H * C * 2


def test_staging_takes_every_source_head_or_only_the_routes_as_the_cost_model_says() -> None:
    """A destination rank that needs half of a source rank's 4 heads: where bytes are dear it
    stages only those 2, where descriptors are dear every head (whole blocks, which merge
    across consecutive blocks; 2 of 4 heads break the run at every block in HND, at every
    token in NHD)."""
    bytes_dear = remote.Costs(per_descriptor=1e-9, wire=1e6, local=1e12, per_permute=0.0)
    descriptors_dear = remote.Costs(per_descriptor=1.0, wire=1e12, local=1e12, per_permute=0.0)
    n, blocks = SRC_EXT["N"], 3
    slots = torch.arange(blocks * n)
    hnd, nhd = "vllm_flash_attn_hnd", "vllm_flash_attn_nhd"
    for layout, cost, staged_heads in ((hnd, bytes_dear, 2), (hnd, descriptors_dear, 4), (nhd, bytes_dear, 2),
                                       (nhd, descriptors_dear, 4)):
        case = Case(layout, "vllm_flash_attn_nhd", dict(SRC_EXT), dict(SRC_EXT), 1, 2, 1, 4)
        srcs, dst = case.caches()
        sd, dd = case.describe(srcs, dst)
        want = case.expected(srcs, dst, slots.tolist(), slots.tolist())
        p = remote.plan(sd, dd, slots, slots, strategy="staged", cost=cost)
        assert p.bytes == blocks * n * SRC_EXT["L"] * 2 * staged_heads * SRC_EXT["C"] * 4, (layout, cost)
        run_by_memmove(p, dst)
        assert same_bits(dst, want)


def _many_blocks(tp_sizes: tuple[int, int] = (1, 1)) -> tuple[Case, list[int], list[int]]:
    """NHD into HND, 2 layers, block 4, 80 source blocks in a scattered block table: a staged
    read of 4 chunks of 20 consecutive source blocks each."""
    ext = {"L": 2, "KV": 2, "B": 96, "N": 4, "H": 2, "C": 8}
    case = Case("vllm_flash_attn_nhd", "vllm_flash_attn_hnd", dict(ext), dict(ext), *tp_sizes, 0, 2 * tp_sizes[0])
    rng = random.Random("many blocks")
    table = rng.sample(range(96), 80)
    src = [b * 4 + k for b in table for k in range(4)]
    dst = rng.sample(range(96 * 4), len(src))
    return case, src, dst


def test_a_staged_read_of_many_blocks_is_cut_into_chunks_that_each_finish_on_their_own() -> None:
    """Chunk c's permute needs only chunk c's reads: after reading chunk 0 and finishing it, the
    destination holds exactly the tokens whose source blocks are in chunk 0 (the rest untouched);
    all chunks then give the reference's destination."""
    case, s, d = _many_blocks()
    srcs, dst = case.caches()
    sd, dd = case.describe(srcs, dst)
    want = case.expected(srcs, dst, s, d)
    p = remote.plan(sd, dd, torch.tensor(s), torch.tensor(d), strategy="staged")
    assert p.chunks == (0, 1, 2, 3) and [st.chunk for st in p.staging] == [0, 1, 2, 3]
    assert [r.chunk for r in p.reads] == [0, 1, 2, 3]
    before = [t.clone() for t in dst]
    first = [r for r in p.reads if r.chunk == 0]
    run_by_memmove(remote.Plan(p.strategy, p.why, p.dst, tuple(first)), dst)  # chunk 0's reads alone
    p.finish(dst, chunk=0)
    moved0 = set(p.staging[0].dst_slots.tolist())
    assert len(moved0) == len(s) // 4
    n = 4
    for got, was, ref in zip(dst, before, want, strict=True):
        for slot in range(96 * n):
            block, k = divmod(slot, n)
            expect = ref if slot in moved0 else was
            assert torch.equal(got[:, block, :, k], expect[:, block, :, k]), slot
    run_by_memmove(p, dst)
    assert same_bits(dst, want)


@pytest.mark.parametrize("sizes", [(2, 1), (1, 2)], ids=lambda s: f"tp{s[0]}->tp{s[1]}")
def test_chunked_staging_moves_like_the_reference_across_tp(sizes: tuple[int, int]) -> None:
    case, s, d = _many_blocks(sizes)
    srcs, dst = case.caches()
    sd, dd = case.describe(srcs, dst)
    want = case.expected(srcs, dst, s, d)
    p = remote.plan(sd, dd, torch.tensor(s), torch.tensor(d), strategy="staged")
    assert len(p.chunks) == 4
    run_by_memmove(p, dst)
    assert same_bits(dst, want)
