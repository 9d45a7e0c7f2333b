"""kvgen.integrations.nixl.StateWorker: a hybrid model's per-request state moved between TP
sizes by NIXL READs between two agents in this process (UCX, DRAM), section by section.

Every source element's value codes its coordinates: the TP-1 element it is (slot and index),
the section of the split dim it lies in and the source rank holding it. The expectation of
each destination element is worked out on its own from the destination's coordinates (which
section and channel of the TP-1 tensor its rank holds there, hence which source rank), with no
use of kvgen's pieces. They skip, saying why, where nixl is not installed."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvgen import remote
from kvgen.integrations import nixl
from kvgen.runtime.errors import KVLayoutError

pytestmark = pytest.mark.skipif(nixl.unavailable() is not None, reason=str(nixl.unavailable()))

SLOTS = 5
#: Per tensor: the shape at TP 1, the split dim and its sections (a conv state's x | B | C,
#: 2048 | 2048 | 4096-like but small; a recurrent state split by heads, one section).
TENSORS = {"conv": ((3, 32), 1, (8, 8, 16)), "ssm": ((4, 3, 2), 0, (4,))}
SRC_SLOTS = [3, 0, -1, 4, 1, 2]
DST_SLOTS = [1, 4, 2, -1, 0, -1]
MAX_SECTIONS, MAX_TP = 4, 8


@pytest.fixture(scope="module")
def agents() -> Iterator[tuple[Any, Any]]:
    api = nixl.api()
    yield tuple(api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=serves, backends=["UCX"]))
                for name, serves in (("state-prefill", True), ("state-decode", False)))


def _where(j: int, sections: tuple[int, ...], tp: int, rank: int) -> tuple[int, int]:
    """(section, TP-1 channel of the split dim) of channel j of rank `rank` of `tp`'s row:
    the row is each section's rank-th tp-th, one after another."""
    start = 0
    for k, n in enumerate(sections):
        share = n // tp
        if j < share:
            return k, start + rank * share + j
        j, start = j - share, start + n
    raise AssertionError("channel past the row")


def _code(shape: tuple[int, ...], slot: int, index: tuple[int, ...], section: int, rank: int) -> int:
    flat = slot * math.prod(shape) + sum(i * math.prod(shape[d + 1:]) for d, i in enumerate(index))
    return (flat * MAX_SECTIONS + section) * MAX_TP + rank


def _rank_shape(shape: tuple[int, ...], split: int, tp: int) -> tuple[int, ...]:
    return tuple(n // tp if d == split else n for d, n in enumerate(shape))


def _source(name: str, rank: int, tp: int) -> torch.Tensor:
    """Source rank `rank` of `tp`'s tensor, each element its code."""
    shape, split, sections = TENSORS[name]
    local = _rank_shape(shape, split, tp)
    t = torch.empty(SLOTS, *local, dtype=torch.int64)
    for slot, *index in itertools.product(range(SLOTS), *map(range, local)):
        k, channel = _where(index[split], sections, tp, rank)
        t[(slot, *index)] = _code(shape, slot, (*index[:split], channel, *index[split + 1:]), k, rank)
    return t


def _before(name: str, tp: int) -> torch.Tensor:
    """A destination tensor before the move: negative values, no source code."""
    shape, split, _ = TENSORS[name]
    local = _rank_shape(shape, split, tp)
    return -1 - torch.arange(SLOTS * math.prod(local), dtype=torch.int64).reshape(SLOTS, *local)


def _expected(name: str, before: torch.Tensor, src_tp: int, dst_tp: int, rank: int) -> torch.Tensor:
    """Destination rank `rank`'s tensor after the move: each moved element the code of the
    source element holding its TP-1 section and channel."""
    shape, split, sections = TENSORS[name]
    want = before.clone()
    for s, d in zip(SRC_SLOTS, DST_SLOTS, strict=True):
        if s < 0 or d < 0:
            continue
        for index in itertools.product(*map(range, before.shape[1:])):
            k, channel = _where(index[split], sections, dst_tp, rank)
            start = sum(sections[:k])
            owner = (channel - start) // (sections[k] // src_tp)
            want[(d, *index)] = _code(shape, s, (*index[:split], channel, *index[split + 1:]), k, owner)
    return want


def _describe(tensors: dict[str, torch.Tensor], rank: int, tp: int, flat: bool = False
              ) -> dict[str, remote.StateDescription]:
    out = {}
    for name, t in tensors.items():
        shape, split, sections = TENSORS[name]
        out[name] = remote.describe_state(t, shape=shape, split=split, sections=None if flat else sections,
                                          tp_rank=rank, tp_size=tp)
    return out


def _pull(agents: tuple[Any, Any], src_tp: int, dst_tp: int, rank: int, flat: bool = False
          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(got, want) of destination rank `rank` of dst_tp after a pull from every source rank."""
    srcs = [{name: _source(name, r, src_tp) for name in TENSORS} for r in range(src_tp)]
    dst = {name: _before(name, dst_tp) for name in TENSORS}
    want = {name: _expected(name, t, src_tp, dst_tp, rank) for name, t in dst.items()}
    prefill = [nixl.StateWorker("state-prefill", t, _describe(t, r, src_tp, flat), agent=agents[0])
               for r, t in enumerate(srcs)]
    decode = nixl.StateWorker("state-decode", dst, _describe(dst, rank, dst_tp, flat), agent=agents[1])
    try:
        for w in prefill:
            decode.connect(w.handshake())
        reads = decode.pull(torch.tensor(SRC_SLOTS), torch.tensor(DST_SLOTS))
        assert set(reads) == set(TENSORS)
    finally:
        decode.close()
        for w in prefill:
            w.close()
    return dst, want


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 4), (4, 2)], ids=lambda n: f"tp{n}")
def test_the_state_moves_by_its_sections_through_nixl(agents: tuple[Any, Any], src_tp: int, dst_tp: int) -> None:
    for rank in range(dst_tp):
        got, want = _pull(agents, src_tp, dst_tp, rank)
        for name in TENSORS:
            wrong = int((got[name] != want[name]).sum())
            assert wrong == 0, f"{name} on destination rank {rank}: {wrong} of {want[name].numel()} elements wrong"
            # The skipped requests' slots (dst 2 from src -1; dst slots 3 untouched) keep their values.
            assert torch.equal(got[name][[2, 3]], _before(name, dst_tp)[[2, 3]])


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 4), (4, 2)], ids=lambda n: f"tp{n}")
def test_a_flat_plan_puts_wrong_channels_on_every_rank(agents: tuple[Any, Any], src_tp: int, dst_tp: int) -> None:
    """Planned as one flat section, the conv state lands with other sections' channels on every
    destination rank (vLLM #37638); the single-section recurrent state is right either way."""
    for rank in range(dst_tp):
        got, want = _pull(agents, src_tp, dst_tp, rank, flat=True)
        assert not torch.equal(got["conv"], want["conv"]), rank
        assert torch.equal(got["ssm"], want["ssm"]), rank


def _pair(agents: tuple[Any, Any], dst_tensors: dict[str, torch.Tensor],
          dst_descs: dict[str, remote.StateDescription]) -> tuple[nixl.StateWorker, nixl.StateWorker]:
    src = {name: _source(name, 0, 2) for name in TENSORS}
    return (nixl.StateWorker("state-prefill", src, _describe(src, 0, 2), agent=agents[0]),
            nixl.StateWorker("state-decode", dst_tensors, dst_descs, agent=agents[1]))


def _no_reads(monkeypatch: pytest.MonkeyPatch, worker: nixl.StateWorker) -> list[Any]:
    posted: list[Any] = []
    monkeypatch.setattr(worker, "_post", lambda *a: posted.append(a))
    return posted


@pytest.mark.parametrize(("what", "change", "message"), [
    ("sections", lambda n, t: remote.describe_state(t, shape=TENSORS[n][0], split=TENSORS[n][1], tp_rank=1,
                                                     tp_size=4), r"sections \(8, 8, 16\) vs \(32,\)"),
    ("dtype", lambda n, t: remote.describe_state(t.float(), shape=TENSORS[n][0], split=TENSORS[n][1],
                                                  sections=TENSORS[n][2], tp_rank=1, tp_size=4),
     "dtype int64 vs float32"),
    ("shape", lambda n, t: remote.describe_state(t.reshape(SLOTS, 6, 4), shape=(6, 16), split=1, sections=(4, 4, 8),
                                                  tp_rank=1, tp_size=4), r"shape \(3, 32\) vs \(6, 16\)"),
])
def test_mismatched_state_is_refused_before_any_read(agents: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch,
                                                     what: str, change: Any, message: str) -> None:
    dst = {name: _before(name, 4) for name in TENSORS}
    if what == "dtype":
        dst["conv"] = dst["conv"].float()
    descs = _describe({"ssm": dst["ssm"]}, 1, 4) | {"conv": change("conv", dst["conv"])}
    before = {k: t.clone() for k, t in dst.items()}
    prefill, decode = _pair(agents, dst, descs)
    posted = _no_reads(monkeypatch, decode)
    try:
        with pytest.raises(KVLayoutError, match=message):
            decode.connect(prefill.handshake())
        assert decode.peers == {}
        with pytest.raises(KVLayoutError, match="connect"):
            decode.pull(torch.tensor([0]), torch.tensor([0]))
        # A description altered after the handshake is refused by the plan, before a READ.
        decode.peers = {0: nixl.StatePeer("state-prefill", prefill.descriptions)}
        with pytest.raises(KVLayoutError, match=message):
            decode.pull(torch.tensor([0]), torch.tensor([0]))
    finally:
        decode.close()
        prefill.close()
    assert posted == []
    assert all(torch.equal(dst[k], before[k]) for k in dst)


def test_bad_slots_are_refused_before_any_tensor_is_read(agents: tuple[Any, Any],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The second tensor's refusal stops the first tensor's reads too: every plan comes first."""
    dst = {"conv": _before("conv", 4), "ssm": _before("ssm", 4)[:3]}
    before = {k: t.clone() for k, t in dst.items()}
    prefill, decode = _pair(agents, dst, _describe(dst, 1, 4))
    posted = _no_reads(monkeypatch, decode)
    try:
        decode.connect(prefill.handshake())
        with pytest.raises(KVLayoutError, match="slot 4 is outside the state tensor's 3 slots"):
            decode.pull(torch.tensor([0, 1]), torch.tensor([0, 4]))
    finally:
        decode.close()
        prefill.close()
    assert posted == []
    assert all(torch.equal(dst[k], before[k]) for k in dst)


def test_handshakes_of_other_tensors_or_garbage_are_refused(agents: tuple[Any, Any]) -> None:
    dst = {name: _before(name, 4) for name in TENSORS}
    prefill, decode = _pair(agents, dst, _describe(dst, 1, 4))
    try:
        with pytest.raises(KVLayoutError, match="not a kvgen NIXL state handshake"):
            decode.connect(b"{}")
        raw = json.loads(prefill.handshake())
        with pytest.raises(KVLayoutError, match="not a kvgen state description"):
            decode.connect(json.dumps({**raw, "states": {"conv": "[1]", "ssm": raw["states"]["ssm"]}}).encode())
        with pytest.raises(KVLayoutError, match=r"holds the state tensors \['conv'\], this rank \['conv', 'ssm'\]"):
            decode.connect(json.dumps({**raw, "states": {"conv": raw["states"]["conv"]}}).encode())
        assert decode.peers == {}
    finally:
        decode.close()
        prefill.close()
    with pytest.raises(KVLayoutError, match="is not of this tensor"):
        nixl.StateWorker("state-decode", {"conv": dst["ssm"]}, {"conv": decode.descriptions["conv"]},
                         agent=agents[1])


def test_a_state_description_survives_its_wire_form() -> None:
    t = _source("conv", 1, 2)
    (shape, split, sections) = TENSORS["conv"]
    d = remote.describe_state(t, shape=shape, split=split, sections=sections, tp_rank=1, tp_size=2)
    assert remote.StateDescription.from_bytes(d.to_bytes()) == d
    for bad in (b"[]", d.to_bytes().replace(b'"int64"', b'"int65"'), d.to_bytes().replace(b'"slots"', b'"slotz"')):
        with pytest.raises(KVLayoutError, match="not a kvgen state description"):
            remote.StateDescription.from_bytes(bad)


def test_workers_on_their_own_agents_move_the_state() -> None:
    """StateWorkers that make their own agents (one UCX worker each) and drop them on close."""
    src = {name: _source(name, 0, 1) for name in TENSORS}
    dst = {name: _before(name, 1) for name in TENSORS}
    prefill = nixl.StateWorker("state-prefill-own", src, _describe(src, 0, 1))
    decode = nixl.StateWorker("state-decode-own", dst, _describe(dst, 0, 1))
    try:
        decode.connect(prefill.handshake())
        decode.pull(torch.tensor([4, 1]), torch.tensor([0, 3]))
    finally:
        decode.close()
        prefill.close()
    for name in TENSORS:
        want = _before(name, 1)
        want[[0, 3]] = src[name][[4, 1]]
        assert torch.equal(dst[name], want), name


def test_a_state_worker_refuses_to_register_more_than_its_tensors_hold(agents: tuple[Any, Any]) -> None:
    dst = {name: _before(name, 4) for name in TENSORS}
    described = _describe(dst, 1, 4)
    wide = {**described, "ssm": dataclasses.replace(described["ssm"], span=described["ssm"].span + 8)}
    with pytest.raises(KVLayoutError, match=f"registers {described['ssm'].span + 8} bytes"):
        nixl.StateWorker("state-decode", dst, wide, agent=agents[1])
