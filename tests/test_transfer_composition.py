"""Transfers composed: A -> B -> A is the identity on the copied slots (every built-in pair
declared both ways, through other block sizes), A -> B -> C equals A -> C, and TP resharding
2 -> 4 -> 2, 8 -> 1 -> 8 and 2 -> 8 -> 2 (replicated heads) through kvgen.tp.plan restores
every head, with the middle ranks checked head by head against the reference."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from harness import builtin_library

from kvgen import generated, tp
from kvgen.oracle.reference import transfers
from kvgen.oracle.scenarios import clone_tree, same_bits
from kvgen.oracle.scenarios.transfers import DST_EXT, SRC_EXT, fitted_extents, make_cache

LIBRARY = builtin_library()
PAIRS = sorted(generated.TRANSFERS)
BOTH_WAYS = sorted((a, b) for a, b in PAIRS if a < b and (b, a) in PAIRS)
#: A's slots (partial blocks, a -1) and B's, in blocks of 8 on B's side.
A_SLOTS = [1, 2, 3, 20, 21, 22, 23, -1, 40, 41, 8, 9]
B_EXT = {**DST_EXT, "N": 8, "B": 5}
B_SLOTS = [13, 14, 15, 24, 25, 26, 27, 28, 3, 4, 33, -1]


def _identity(spec: Any, ext: dict[str, int], source: Any, into: Any, slots: list[int], skip: list[int]) -> Any:
    """`into` with the slots that moved both ways copied from `source` (A to A by the reference)."""
    want = clone_tree(into)
    moved = [s if t >= 0 else -1 for s, t in zip(slots, skip, strict=True)]
    transfers.transfer(transfers.TransferSide(spec, ext, source, moved),
        transfers.TransferSide(spec, ext, want, moved))
    return want


@pytest.mark.parametrize("pair", BOTH_WAYS, ids=lambda p: f"{p[0]}-{p[1]}")
def test_there_and_back_is_the_identity_on_the_copied_slots(pair: tuple[str, str]) -> None:
    a_spec, b_spec = LIBRARY[pair[0]], LIBRARY[pair[1]]
    a_ext, b_ext = fitted_extents((a_spec, b_spec), (SRC_EXT, B_EXT))  # heads in whole groups where a cache groups them
    a = make_cache(a_spec, a_ext, torch.float32, "cpu")
    b = make_cache(b_spec, b_ext, torch.float32, "cpu", 10000)
    back = make_cache(a_spec, a_ext, torch.float32, "cpu", 20000)
    s, m = torch.tensor(A_SLOTS), torch.tensor(B_SLOTS)
    generated.transfer(*pair)().copy(a, s, b, m)
    for _ in generated.transfer(pair[1], pair[0])().copy_layers(b, m, back, s):
        pass
    assert same_bits(back, _identity(a_spec, a_ext, a, back, A_SLOTS, B_SLOTS))


def _triples() -> list[tuple[str, str, str]]:
    found = [(a, b, c) for a, b, c in itertools.permutations(sorted({x for p in PAIRS for x in p}), 3)
             if {(a, b), (b, c), (a, c)} <= set(PAIRS)]
    return found[::max(1, len(found) // 12)]  # a spread of a dozen


@pytest.mark.parametrize("triple", _triples(), ids=lambda t: "-".join(t))
def test_through_a_third_layout_equals_direct(triple: tuple[str, str, str]) -> None:
    a_spec, b_spec, c_spec = (LIBRARY[n] for n in triple)
    a_ext, b_ext, c_ext = fitted_extents((a_spec, b_spec, c_spec), (SRC_EXT, B_EXT, {**DST_EXT, "N": 2, "B": 20}))
    a = make_cache(a_spec, a_ext, torch.float32, "cpu")
    b = make_cache(b_spec, b_ext, torch.float32, "cpu", 10000)
    via, direct = (make_cache(c_spec, c_ext, torch.float32, "cpu", 20000) for _ in range(2))
    s = torch.tensor([5, 6, 7, 8, 9, 10, 11, 29, 30])  # a -1 here would leave B stale for the second hop
    m = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8])  # every token lands in B
    d = torch.tensor([0, 1, 2, 3, -1, 37, 38, 39, 12])
    generated.transfer(triple[0], triple[1])().copy(a, s, b, m)
    generated.transfer(triple[1], triple[2])().copy(b, m, via, d)
    generated.transfer(triple[0], triple[2])().copy(a, s, direct, d)
    assert same_bits(via, direct)
    assert not same_bits(direct, make_cache(c_spec, c_ext, torch.float32, "cpu", 20000))  # something moved


# -- TP resharding ---------------------------------------------------------------------------------------

SLOTS = [3, 4, 5, 6, 7, 16, 17, 18, 19, -1, 33]
MID_SLOTS = [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 39]


def _ranks(spec: Any, heads: int, tp_size: int, salt: int) -> list[Any]:
    return [make_cache(spec, {**SRC_EXT, "H": heads}, torch.float32, "cpu", salt + 100000 * r) for r in range(tp_size)]


def _move(routes: tuple[tp.Route, ...], pair: tuple[str, str], src: list[Any], s: list[int], dst: list[Any],
          d: list[int]) -> None:
    t = generated.transfer(*pair)()
    for r in routes:
        t.copy(src[r.src_rank], torch.tensor(s), dst[r.dst_rank], torch.tensor(d), heads=r.heads)


@pytest.mark.parametrize("heads,there,mid", [(8, 2, 4), (8, 8, 1), (2, 2, 8), (4, 4, 4)],
                         ids=["8 heads 2-4-2", "8 heads 8-1-8", "2 heads 2-8-2", "4 heads 4-4-4"])
def test_resharding_there_and_back_restores_every_head(heads: int, there: int, mid: int) -> None:
    nhd, hnd = LIBRARY["vllm_flash_attn_nhd"], LIBRARY["vllm_flash_attn_hnd"]
    local, mid_local = tp.local_heads(heads, there), tp.local_heads(heads, mid)
    origin = _ranks(nhd, local, there, 0)
    middle = _ranks(hnd, mid_local, mid, 5000)
    expected_middle = [clone_tree(c) for c in middle]
    _move(tp.plan(heads, there, mid), ("vllm_flash_attn_nhd", "vllm_flash_attn_hnd"), origin, SLOTS, middle,
          MID_SLOTS)
    # Every middle rank holds its global heads, each copied from a source rank holding that head
    # (worked out here from the engines' sharding rule, not from kvgen.tp).
    for d in range(mid):
        for j in range(mid_local):
            g = d * heads // mid if mid > heads else d * mid_local + j
            s, sh = (g * (there // heads), 0) if there > heads else divmod(g, local)
            transfers.transfer(
                transfers.TransferSide(nhd, {**SRC_EXT, "H": local}, origin[s], SLOTS, (sh, sh + 1)),
                transfers.TransferSide(hnd, {**SRC_EXT, "H": mid_local}, expected_middle[d], MID_SLOTS,
                                                (j, j + 1)))
    assert all(same_bits(got, want) for got, want in zip(middle, expected_middle, strict=True))
    back = _ranks(nhd, local, there, 9000)
    _move(tp.plan(heads, mid, there), ("vllm_flash_attn_hnd", "vllm_flash_attn_nhd"), middle, MID_SLOTS, back,
          SLOTS)
    for r in range(there):
        assert same_bits(back[r], _identity(nhd, {**SRC_EXT, "H": local}, origin[r], back[r], SLOTS, MID_SLOTS))


def test_resharding_an_mla_latent_reads_one_source_per_destination() -> None:
    mla, host = LIBRARY["vllm_mla"], LIBRARY["hicache_mla_page_first"]
    latent = make_cache(mla, SRC_EXT, torch.float32, "cpu")
    sources = [clone_tree(latent) for _ in range(2)]  # replicated: every rank holds the same latent
    dests = [make_cache(host, DST_EXT, torch.float32, "cpu", 10000) for _ in range(4)]
    routes = tp.plan(1, 2, 4, mla=True)
    assert sorted(r.dst_rank for r in routes) == [0, 1, 2, 3]
    _move(routes, (mla.name, host.name), sources, SLOTS, dests, MID_SLOTS)
    want = make_cache(host, DST_EXT, torch.float32, "cpu", 10000)
    transfers.transfer(transfers.TransferSide(mla, SRC_EXT, latent, SLOTS),
        transfers.TransferSide(host, DST_EXT, want, MID_SLOTS))
    assert all(same_bits(d, want) for d in dests)
