"""kvgen.integrations.nixl: plans carried out by NIXL's READs between two agents in this
process (UCX, DRAM), checked element by element against the independent transfer reference.
They skip, saying why, where nixl is not installed (`pip install --no-deps nixl-cu12==1.5.1`)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvgen import remote
from kvgen.integrations import nixl
from kvgen.oracle.scenarios import clone_tree, same_bits
from kvgen.oracle.scenarios.transfers import SCENARIOS
from kvgen.runtime.errors import KVLayoutError
from tests.remote_harness import REMOTE_PAIRS, Case, PartsCase

pytestmark = pytest.mark.skipif(nixl.unavailable() is not None, reason=str(nixl.unavailable()))


@pytest.fixture(scope="module")
def agents() -> Iterator[tuple[Any, Any]]:
    """One prefill and one decode agent for every test here (an agent takes ~0.5 s to start); as
    nixl.new_agent's `serves`, only the agent read from runs NIXL's progress thread."""
    api = nixl.api()
    yield tuple(api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=serves, backends=["UCX"]))
                for name, serves in (("prefill", True), ("decode", False)))


def _moved(agents: tuple[Any, Any], case: Case, scenario: str, strategy: str | None) -> tuple[bool, remote.Plan]:
    sc = SCENARIOS[scenario]
    s_slots, d_slots = sc.mapping(random.Random(f"{case.src}/{case.dst}/{scenario}"), case.src_ext, case.dst_ext)
    srcs, dst = case.caches()
    sd, dd = case.describe(srcs, dst)
    want = case.expected(srcs, dst, s_slots, d_slots)
    # Every source rank on the one prefill agent: each rank's cache registered there.
    prefill = [nixl.Worker("prefill", c, d, agent=agents[0]) for c, d in zip(srcs, sd, strict=True)]
    decode = nixl.Worker("decode", dst, dd, agent=agents[1])
    try:
        for w in prefill:
            decode.connect(w.handshake())
        p = decode.pull(torch.tensor(s_slots), torch.tensor(d_slots), strategy=strategy)
    finally:
        decode.close()
        for w in prefill:
            w.close()
    return same_bits(dst, want), p


def _case(pair: tuple[str, str], scenario: str, sizes: tuple[int, int] = (1, 1), rank: int = 0) -> Case:
    sc = SCENARIOS[scenario]
    return Case(*pair, dict(sc.src_ext), dict(sc.dst_ext), *sizes, rank, 4 if sizes != (1, 1) else 2)


@pytest.mark.parametrize("strategy", ["direct", "staged"])
@pytest.mark.parametrize("pair", REMOTE_PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
def test_every_builtin_pair_through_nixl(agents: tuple[Any, Any], pair: tuple[str, str], strategy: str) -> None:
    ok, p = _moved(agents, _case(pair, "partial_minus1"), "partial_minus1", strategy)
    assert ok and p.strategy == strategy


@pytest.mark.parametrize("scenario", ["larger_dst_blocks", "smaller_dst_blocks", "random_slots", "all_skipped"])
def test_block_sizes_and_skipped_tokens_through_nixl(agents: tuple[Any, Any], scenario: str) -> None:
    for strategy in ("direct", "staged", None):
        assert _moved(agents, _case(("vllm_flash_attn_nhd", "vllm_flash_attn_hnd"), scenario), scenario, strategy)[0]


@pytest.mark.parametrize("sizes", [(2, 4), (4, 2), (2, 8)], ids=lambda s: f"tp{s[0]}->tp{s[1]}")
@pytest.mark.parametrize("pair", [("vllm_flash_attn_nhd", "vllm_flash_attn_hnd"), ("sglang_mla", "vllm_mla")],
                         ids=lambda p: f"{p[0]}->{p[1]}")
def test_tp_resharding_through_nixl(agents: tuple[Any, Any], pair: tuple[str, str], sizes: tuple[int, int]) -> None:
    for rank in range(sizes[1]):
        assert _moved(agents, _case(pair, "partial_minus1", sizes, rank), "partial_minus1", None)[0], rank


def test_a_mismatched_handshake_is_refused_before_any_read(agents: tuple[Any, Any]) -> None:
    case = _case(("vllm_flash_attn_nhd", "vllm_flash_attn_hnd"), "partial_minus1")
    srcs, dst = case.caches(torch.float16)
    sd, _ = case.describe(srcs, dst)
    other = Case(case.src, case.dst, case.src_ext, case.dst_ext, 1, 1, 0, 2).caches(torch.float32)[1]
    dd = remote.describe(other, case.dst, tp_rank=0, tp_size=1)
    before = clone_tree(other)
    prefill = nixl.Worker("prefill", srcs[0], sd[0], agent=agents[0])
    decode = nixl.Worker("decode", other, dd, agent=agents[1])
    try:
        with pytest.raises(KVLayoutError, match="dtype float16 vs float32"):
            decode.connect(prefill.handshake())
        assert decode.peers == {}
        with pytest.raises(KVLayoutError, match="connect"):
            decode.pull(torch.arange(4), torch.arange(4))
        # A description altered after the handshake is refused by the plan, before a READ.
        decode.peers = {0: nixl.Peer("prefill", sd[0])}
        with pytest.raises(KVLayoutError, match="dtype"):
            decode.pull(torch.arange(4), torch.arange(4))
    finally:
        decode.close()
        prefill.close()
    assert same_bits(other, before)


def test_a_worker_refuses_a_description_of_other_caches(agents: tuple[Any, Any]) -> None:
    case = _case(("vllm_flash_attn_nhd", "vllm_flash_attn_hnd"), "partial_minus1")
    srcs, dst = case.caches()
    sd, _ = case.describe(srcs, dst)
    with pytest.raises(KVLayoutError, match="not of these caches"):
        nixl.Worker("prefill", dst, sd[0], agent=agents[0])


def test_garbage_handshakes_are_refused(agents: tuple[Any, Any]) -> None:
    case = _case(("vllm_flash_attn_nhd", "vllm_flash_attn_hnd"), "partial_minus1")
    srcs, dst = case.caches()
    _, dd = case.describe(srcs, dst)
    decode = nixl.Worker("decode", dst, dd, agent=agents[1])
    try:
        with pytest.raises(KVLayoutError, match="not a kvgen NIXL handshake"):
            decode.connect(b"{}")
    finally:
        decode.close()


@pytest.mark.parametrize("strategy", ["direct", "staged"])
def test_reads_posted_from_several_streams_in_chunks_arrive_exactly(strategy: str) -> None:
    """A decode worker on its own agent posts each read cut into STREAMS parts from as many
    threads, and permutes staged chunk c while later chunks are read: every element lands as
    the reference says, again on a second run of the same plan."""
    from tests.test_remote_plan import _many_blocks

    case, s, d = _many_blocks()
    srcs, dst = case.caches()
    sd, dd = case.describe(srcs, dst)
    want = case.expected(srcs, dst, s, d)
    initial = [t.clone() for t in dst]
    prefill = nixl.Worker("prefill-streams", srcs[0], sd[0])
    decode = nixl.Worker("decode-streams", dst, dd)
    try:
        assert decode.streams == nixl.STREAMS > 1
        decode.connect(prefill.handshake())
        p = decode.pull(torch.tensor(s), torch.tensor(d), strategy=strategy)
        assert same_bits(dst, want)
        assert len(p.chunks) == (4 if strategy == "staged" else 1)
        assert all(len(nixl.parts(r.src_descs, r.dst_descs, decode.streams)) == decode.streams for r in p.reads
                   if len(r.dst_descs) >= nixl.SPLIT_AT)
        for t, was in zip(dst, initial, strict=True):
            t.copy_(was)
        decode.run(p)
        assert same_bits(dst, want)
    finally:
        decode.close()
        prefill.close()


def test_parts_keep_every_descriptor_pair_once_in_order() -> None:
    src = torch.arange(300).reshape(100, 3).numpy() * 7
    dst = src + 1
    dst[:, 1] = src[:, 1] = torch.arange(1, 101).numpy()
    cut = nixl.parts(src, dst, 3)
    assert len(cut) == 3
    assert (torch.cat([torch.from_numpy(a) for a, _ in cut]).numpy() == src).all()
    assert (torch.cat([torch.from_numpy(b) for _, b in cut]).numpy() == dst).all()
    sizes = [int(b[:, 1].sum()) for _, b in cut]
    assert max(sizes) - min(sizes) <= 100  # about equal bytes (within one descriptor)
    assert len(nixl.parts(src[:10], dst[:10], 3)) == 1  # too few to cut


@pytest.mark.parametrize(("spec", "sizes"), [("sglang_mha_v_head", (2, 4)), ("sglang_mha_v_head", (4, 2)),
                                             ("vllm_ascend_mla", (1, 2))], ids=lambda x: str(x))
def test_a_cache_of_several_parts_through_nixl(agents: tuple[Any, Any], spec: str, sizes: tuple[int, int]) -> None:
    """Every part (K and V of different widths; MLA latent and rope) registered and read: each
    element as its (part, layer, head, slot, channel) code and its source rank say."""
    s_slots, d_slots = [3, 0, -1, 9, 15, 4], [1, 12, 2, -1, 7, 8]
    for rank in range(sizes[1]):
        case = PartsCase(spec, *sizes, rank, blocks=(4, 8))
        srcs, dst = case.caches()
        sd, dd = case.describe(srcs, dst)
        prefill = [nixl.Worker("prefill", c, d, agent=agents[0]) for c, d in zip(srcs, sd, strict=True)]
        decode = nixl.Worker("decode", dst, dd, agent=agents[1])
        try:
            for w in prefill:
                decode.connect(w.handshake())
            p = decode.pull(torch.tensor(s_slots), torch.tensor(d_slots))
        finally:
            decode.close()
            for w in prefill:
                w.close()
        assert len(p.reads) >= 2 and same_bits(dst, case.expected(s_slots, d_slots)), rank


def test_a_worker_refuses_to_register_more_than_its_caches_hold(agents: tuple[Any, Any]) -> None:
    """A READ writes every registered byte: a description whose span reaches past its leaves is refused
    before anything is registered."""
    case = _case(("vllm_flash_attn_nhd", "vllm_flash_attn_hnd"), "partial_minus1")
    srcs, dst = case.caches()
    sd, _ = case.describe(srcs, dst)
    wide = dataclasses.replace(sd[0], span=sd[0].span + 2)
    with pytest.raises(KVLayoutError, match=f"registers {sd[0].span + 2} bytes at .*, where the tensor's view holds "
                                            f"{sd[0].span}"):
        nixl.Worker("prefill", srcs[0], wide, agent=agents[0])
