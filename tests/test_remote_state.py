"""Hybrid models' per-request state across TP sizes (kvgen.remote.plan_state), by sections.

Qwen3-Next's conv state is [S, 3, 8192 / tp] whose channel dim is q | k | v (2048, 2048, 4096
at TP 1, the model spec's `sections:`), each divided over TP on its own, as vLLM's conv1d
weight loader divides them. Every element of a coordinate-coded state moved between TP
sizes is checked against an independent reference: the TP-1 state cut per section with
plain slicing, as vLLM shards it.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvgen import remote
from kvgen.runtime.errors import KVLayoutError
from kvgen.spec.library import load_library

SLOTS = 6


def _conv_spec() -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    (conv,) = [t for s in load_library().model("qwen3_next_80b_a3b").states for t in s.tensors if t.name == "conv"]
    assert conv.sections is not None
    return conv.shape, conv.split, conv.sections


def _full(shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """The TP-1 state of SLOTS slots: each element's value is its (salt, slot, row, channel)
    coordinate, so a swapped section, row or slot shows."""
    n = torch.Size(shape).numel()
    codes = torch.arange(SLOTS * n, dtype=torch.float64).reshape(SLOTS, *shape)
    return (codes + salt * SLOTS * n).to(torch.float32)


def _shard(full: torch.Tensor, split: int, sections: tuple[int, ...], rank: int, tp: int) -> torch.Tensor:
    """Rank `rank` of `tp`'s state: of every section, its rank-th tp-th, concatenated (the
    reference: slicing, no interval arithmetic)."""
    dim, out, start = split + 1, [], 0
    for n in sections:
        part = n // tp
        out.append(full.narrow(dim, start + rank * part, part))
        start += n
    return torch.cat(out, dim=dim).contiguous()


def _memmove(reads: tuple[remote.Read, ...]) -> None:
    for r in reads:
        for (sa, n, _), (da, m, _) in zip(r.src_descs.tolist(), r.dst_descs.tolist(), strict=True):
            assert n == m
            ctypes.memmove(da, sa, n)


def _move(shape: tuple[int, ...], split: int, sections: tuple[int, ...], src_tp: int, dst_tp: int,
          src_slots: list[int], dst_slots: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(got, want) of every destination rank, moving src_slots[i] to dst_slots[i]."""
    full = _full(shape, 1)
    srcs = [_shard(full, split, sections, r, src_tp) for r in range(src_tp)]
    descs = [remote.describe_state(t, shape=shape, split=split, sections=sections, tp_rank=r, tp_size=src_tp)
             for r, t in enumerate(srcs)]
    got, want = [], []
    for rank in range(dst_tp):
        here = _shard(_full(shape, 2), split, sections, rank, dst_tp)  # what was there: other coordinates
        expected = here.clone()
        reference = _shard(full, split, sections, rank, dst_tp)
        for s, d in zip(src_slots, dst_slots, strict=True):
            if s >= 0 and d >= 0:
                expected[d] = reference[s]
        d = remote.describe_state(here, shape=shape, split=split, sections=sections, tp_rank=rank, tp_size=dst_tp)
        _memmove(remote.plan_state(descs, d, torch.tensor(src_slots), torch.tensor(dst_slots)))
        got.append(here)
        want.append(expected)
    return got, want


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 2), (2, 4), (4, 2), (2, 1), (4, 4)])
def test_the_conv_state_moves_by_its_q_k_v_sections(src_tp: int, dst_tp: int) -> None:
    shape, split, sections = _conv_spec()
    assert (shape, split, sections) == ((3, 8192), 1, (2048, 2048, 4096))
    got, want = _move(shape, split, sections, src_tp, dst_tp, [4, 0, -1, 5], [1, 3, 2, -1])
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"destination rank {rank}: {int((g != w).sum())} elements wrong"


def test_a_flat_split_would_put_other_channels_on_the_ranks() -> None:
    """What the sections prevent: the same move planned as one flat section differs from vLLM's
    sharding on every destination rank (vLLM #37638): rank 0 of 4 would get q[0:1024] | k[0:1024]
    of source rank 0's row, not q[0:512] | k[0:512] | v[0:1024]."""
    shape, split, sections = _conv_spec()
    full = _full(shape, 1)
    flat = (shape[split],)
    srcs = [_shard(full, split, sections, r, 2) for r in range(2)]
    descs = [remote.describe_state(t, shape=shape, split=split, sections=flat, tp_rank=r, tp_size=2)
             for r, t in enumerate(srcs)]
    wrong = []
    for rank in range(4):
        here = torch.zeros(SLOTS, 3, 2048)
        d = remote.describe_state(here, shape=shape, split=split, sections=flat, tp_rank=rank, tp_size=4)
        _memmove(remote.plan_state(descs, d, torch.tensor([0]), torch.tensor([0])))
        wrong.append(not torch.equal(here[0], _shard(full, split, sections, rank, 4)[0]))
    assert wrong == [True, True, True, True]


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 2), (2, 4), (4, 2)])
def test_a_state_split_on_its_first_dim_moves_whole_heads(src_tp: int, dst_tp: int) -> None:
    """The recurrent state [S, 32 / tp, 128, 128]-like: one section, heads outermost."""
    shape = (8, 4, 2)
    got, want = _move(shape, 0, (8,), src_tp, dst_tp, [0, 1, 2], [2, 0, 1])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_a_replicated_state_is_read_whole_from_one_rank() -> None:
    shape = (3, 4)
    srcs = [_full(shape, 1 + r) for r in range(2)]
    descs = [remote.describe_state(t, shape=shape, tp_rank=r, tp_size=2) for r, t in enumerate(srcs)]
    here = torch.zeros(SLOTS, *shape)
    d = remote.describe_state(here, shape=shape, tp_rank=3, tp_size=4)
    (read,) = remote.plan_state(descs, d, torch.tensor([2]), torch.tensor([5]))
    assert read.src_rank == 1 and len(read.src_descs) == 1
    _memmove((read,))
    assert torch.equal(here[5], srcs[1][2]) and not here[:5].any()


def test_runs_merge_per_slot_and_row() -> None:
    """2 -> 4: each destination rank's share of each section lies in one source rank: one
    descriptor per (slot, row, section) of that section's share."""
    shape, split, sections = _conv_spec()
    srcs = [torch.zeros(SLOTS, 3, 4096) for _ in range(2)]
    descs = [remote.describe_state(t, shape=shape, split=split, sections=sections, tp_rank=r, tp_size=2)
             for r, t in enumerate(srcs)]
    d = remote.describe_state(torch.zeros(SLOTS, 3, 2048), shape=shape, split=split, sections=sections, tp_rank=1,
                              tp_size=4)
    (read,) = remote.plan_state(descs, d, torch.tensor([0, 1]), torch.tensor([2, 3]))
    assert read.src_rank == 0
    assert sorted(read.dst_descs[:, 1].tolist()) == sorted([512 * 4, 512 * 4, 1024 * 4] * 3 * 2)


def test_mismatched_states_and_slots_are_refused() -> None:
    shape, split, sections = _conv_spec()
    src = remote.describe_state(torch.zeros(SLOTS, 3, 8192), shape=shape, split=split, sections=sections,
                                tp_rank=0, tp_size=1)
    flat = remote.describe_state(torch.zeros(SLOTS, 3, 4096), shape=shape, split=split, tp_rank=0, tp_size=2)
    with pytest.raises(KVLayoutError, match=r"sections \(2048, 2048, 4096\) vs \(8192,\)"):
        remote.plan_state(src, flat, torch.tensor([0]), torch.tensor([0]))
    dst = remote.describe_state(torch.zeros(SLOTS, 3, 4096), shape=shape, split=split, sections=sections,
                                tp_rank=0, tp_size=2)
    with pytest.raises(KVLayoutError, match="slot 6 is outside"):
        remote.plan_state(src, dst, torch.tensor([6]), torch.tensor([0]))
    with pytest.raises(KVLayoutError, match="written by more than one"):
        remote.plan_state(src, dst, torch.tensor([0, 1]), torch.tensor([2, 2]))
    with pytest.raises(KVLayoutError, match="expected \\[S, 3, 4096\\]"):
        remote.describe_state(torch.zeros(SLOTS, 3, 8192), shape=shape, split=split, sections=sections, tp_rank=0,
                              tp_size=2)
    with pytest.raises(KVLayoutError, match="each divide by tp_size 3"):
        remote.describe_state(torch.zeros(SLOTS, 3, 2730), shape=shape, split=split, sections=sections, tp_rank=0,
                              tp_size=3)
    with pytest.raises(KVLayoutError, match="must be contiguous"):
        remote.describe_state(torch.zeros(SLOTS, 8192, 3).transpose(1, 2), shape=shape, split=split,
                              sections=sections, tp_rank=0, tp_size=1)
