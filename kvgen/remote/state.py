"""Per-request state of hybrid models (Mamba, gated delta net) across TP sizes, by sections.

A state tensor is [S, *shape / TP]: one row per request slot. Its split dim may concatenate
sections that TP divides each on its own: a Mamba2 conv state is x | B | C and a gated delta
net's is q | k | v (vLLM's `mamba_v2_sharded_weight_loader` gives rank r of t the r-th t-th of
every section, concatenated). Moving it between TP sizes flat, as if the split dim were one
section, puts the wrong channels on every rank but one (vLLM #37638); `plan_state` moves each
section's share on its own.

    src = [remote.describe_state(t, shape=(3, 8192), split=1, sections=(2048, 2048, 4096),
                                 tp_rank=r, tp_size=2) for r, t in enumerate(prefill_tensors)]
    dst = remote.describe_state(mine, shape=(3, 8192), split=1, sections=(2048, 2048, 4096),
                                tp_rank=1, tp_size=4)
    reads = remote.plan_state(src, dst, src_slots, dst_slots)   # one Read per source rank

The shape, split and sections come from the model spec (`state: ... tensors:` entries; the
sections are its `sections:` list).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch

from kvgen.remote.plan import Read
from kvgen.remote.runs import merge
from kvgen.runtime.errors import KVLayoutError

#: One piece of a section: (source rank, source offset, destination offset, length), offsets
#: and length in elements of the split dim, offsets local to each rank's rows.
Piece = tuple[int, int, int, int]


@dataclass(frozen=True)
class StateDescription:
    """One rank's state tensor, as the other side of a transfer sees it."""

    dtype: str
    #: The per-slot shape at TP 1, the dim TP divides (None: every rank holds it all) and the
    #: sections of that dim at TP 1.
    shape: tuple[int, ...]
    split: int | None
    sections: tuple[int, ...]
    address: int
    slots: int
    #: Byte strides of the slot dim, then of each dim of shape.
    strides: tuple[int, ...]
    span: int
    tp_rank: int
    tp_size: int
    device_id: int = 0

    @property
    def itemsize(self) -> int:
        return getattr(torch, self.dtype).itemsize

    def rank_shape(self) -> tuple[int, ...]:
        return tuple(n // self.tp_size if i == self.split else n for i, n in enumerate(self.shape))

    def to_bytes(self) -> bytes:
        """The wire form: JSON of every field."""
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes | str) -> StateDescription:
        """A description from its wire form; KVLayoutError for anything else (a field missing,
        unknown or of the wrong type, a dtype torch does not have)."""
        try:
            raw = json.loads(data)
            names = {f.name for f in fields(cls)}
            if not isinstance(raw, dict) or set(raw) - names:
                raise ValueError(f"fields {sorted(set(raw) - names) if isinstance(raw, dict) else raw!r}")
            found = cls(**{**raw, **{k: tuple(int(n) for n in raw[k]) for k in ("shape", "sections", "strides")}})
            ints = (found.address, found.slots, found.span, found.tp_rank, found.tp_size, found.device_id)
            if not all(isinstance(n, int) for n in ints) or not (found.split is None or isinstance(found.split, int)):
                raise TypeError("address, slots, span, ranks and split must be integers")
            if not isinstance(getattr(torch, str(found.dtype), None), torch.dtype):
                raise TypeError(f"dtype {found.dtype!r} is not a torch dtype")
        except (ValueError, TypeError, KeyError) as why:
            raise KVLayoutError(f"not a kvgen state description: {why} (got {str(data)[:80]!r})") from why
        return found

    def __str__(self) -> str:
        return (f"state {self.dtype} [S={self.slots}, {', '.join(map(str, self.rank_shape()))}] split "
                f"{self.split} sections {list(self.sections)} tp {self.tp_rank}/{self.tp_size}")


def describe_state(tensor: torch.Tensor, *, shape: Sequence[int], split: int | None = None,
                   sections: Sequence[int] | None = None, tp_rank: int, tp_size: int) -> StateDescription:
    """Describe one rank's state tensor [S, *shape / tp_size] (shape, split and sections at TP 1,
    as the model spec gives them; the device id is the tensor's device index). KVLayoutError when
    the tensor or the sections do not fit."""
    shape = tuple(int(n) for n in shape)
    if split is None:
        secs: tuple[int, ...] = ()
    else:
        if not 0 <= split < len(shape):
            raise KVLayoutError(f"split {split} is not a dim of shape {list(shape)}")
        secs = tuple(sections) if sections is not None else (shape[split],)
        if sum(secs) != shape[split] or any(n % tp_size for n in secs):
            raise KVLayoutError(f"the sections {list(secs)} of split dim {split} (shape {list(shape)}) must sum "
                                f"to {shape[split]} and each divide by tp_size {tp_size}")
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != len(shape) + 1:
        raise KVLayoutError(f"a state tensor must be [S, {', '.join(map(str, shape))} / tp], got "
                            f"{getattr(tensor, 'shape', type(tensor).__name__)}")
    if not 0 <= tp_rank < tp_size:
        raise KVLayoutError(f"tp_rank {tp_rank} is not one of the {tp_size} ranks")
    d = StateDescription(str(tensor.dtype).removeprefix("torch."), shape, split, secs, tensor.data_ptr(),
                         tensor.shape[0], tuple(s * tensor.element_size() for s in tensor.stride()),
                         (sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True)) + 1)
                         * tensor.element_size(), tp_rank, tp_size, tensor.device.index or 0)
    if tuple(tensor.shape[1:]) != d.rank_shape():
        raise KVLayoutError(f"{d}: the tensor is {list(tensor.shape)}, expected [S, "
                            f"{', '.join(map(str, d.rank_shape()))}]")
    _check_contiguous(d)
    return d


def _check_contiguous(d: StateDescription) -> None:
    """The split dim and the dims inside it (the whole row when nothing splits) must be dense:
    a share of a section is then one run per index of the dims outside."""
    at = d.split if d.split is not None else 0
    want = [d.itemsize * math.prod(d.rank_shape()[k + 1:]) for k in range(len(d.shape))]
    if list(d.strides[1 + at:]) != want[at:]:
        raise KVLayoutError(f"{d}: the split dim and the dims inside it must be contiguous (byte strides "
                            f"{want[at:]}), got {list(d.strides[1 + at:])}")


def pieces(shape_split: int, sections: Sequence[int], src_tp: int, dst_tp: int, dst_rank: int) -> list[Piece]:
    """Where destination rank `dst_rank` of `dst_tp` finds its share of each section: pieces of
    the source ranks' rows (a source rank r of t holds [r n / t, (r + 1) n / t) of each section
    of n, the sections one after another in its row)."""
    out: list[Piece] = []
    s_at = d_at = 0  # where the section starts in a source row, in a destination row
    for n in sections:
        s_len, d_len = n // src_tp, n // dst_tp
        lo, hi = dst_rank * d_len, (dst_rank + 1) * d_len  # the section's elements this rank holds
        for r in range(lo // s_len, -(-hi // s_len)):
            a, b = max(lo, r * s_len), min(hi, (r + 1) * s_len)
            out.append((r, s_at + a - r * s_len, d_at + a - lo, b - a))
        s_at, d_at = s_at + s_len, d_at + d_len
    assert sum(p[3] for p in out) == shape_split // dst_tp
    return out


def _check(src: dict[int, StateDescription], dst: StateDescription) -> None:
    first = next(iter(src.values()))
    for d in src.values():
        theirs = (d.dtype, d.shape, d.split, d.sections, d.tp_size)
        if theirs != (first.dtype, first.shape, first.split, first.sections, first.tp_size):
            raise KVLayoutError(f"every source must hold one state tensor and TP size: {first} and {d}")
    check_state_pair(first, dst)


def check_state_pair(src: StateDescription, dst: StateDescription) -> None:
    """Refuse two state tensors that cannot exchange state (dtype, shape, split or sections
    differ), naming both."""
    first = src
    problems = [f"{what} {a} vs {b}" for what, a, b in (
        ("dtype", first.dtype, dst.dtype), ("shape", first.shape, dst.shape), ("split", first.split, dst.split),
        ("sections", first.sections, dst.sections)) if a != b]
    if problems:
        raise KVLayoutError(f"the two state tensors cannot exchange state ({'; '.join(problems)}): source {first}; "
                            f"destination {dst}")


def _slots(src_slots: Any, dst_slots: Any, src_n: int, dst_n: int) -> tuple[np.ndarray, np.ndarray]:
    s, t = (torch.as_tensor(x).cpu().long().numpy().reshape(-1) for x in (src_slots, dst_slots))
    if s.size != t.size:
        raise KVLayoutError(f"src_slots and dst_slots must have one slot per request: {s.size} and {t.size}")
    keep = (s >= 0) & (t >= 0)
    for what, v, n in (("src_slots", s[keep], src_n), ("dst_slots", t[keep], dst_n)):
        if v.size and int(v.max()) >= n:
            raise KVLayoutError(f"{what}: slot {int(v.max())} is outside the state tensor's {n} slots")
    if np.unique(t[keep]).size != t[keep].size:
        raise KVLayoutError("dst_slots: a destination slot is written by more than one request")
    return s[keep], t[keep]


def _grid(d: StateDescription, slots: np.ndarray, offset: int) -> np.ndarray:
    """Byte addresses of (slot, index over the dims outside the split) at split offset `offset`."""
    at = d.split if d.split is not None else 0
    addr = d.address + slots[:, None] * d.strides[0] + offset * d.strides[1 + at]
    for k in range(at):
        idx = np.arange(d.rank_shape()[k], dtype=np.int64) * d.strides[1 + k]
        addr = (addr[..., None] + idx).reshape(addr.shape[0], -1)
    return addr.reshape(-1)


def plan_state(src: StateDescription | Sequence[StateDescription], dst: StateDescription, src_slots: Any,
               dst_slots: Any) -> tuple[Read, ...]:
    """The reads that move request i's state row from source slot src_slots[i] to destination
    slot dst_slots[i] (< 0 skips it) of destination rank `dst`, each section's share from the
    source rank that holds it. Row i of a read's src_descs lands at row i of its dst_descs."""
    given = [src] if isinstance(src, StateDescription) else list(src)
    if not given:
        raise KVLayoutError("plan_state needs at least one source description")
    by_rank = {d.tp_rank: d for d in given}
    _check(by_rank, dst)
    s_tp = given[0].tp_size
    if dst.split is None:
        parts = [(dst.tp_rank % s_tp, 0, 0, 1)]
    else:
        parts = pieces(dst.shape[dst.split], dst.sections, s_tp, dst.tp_size, dst.tp_rank)
    missing = sorted({p[0] for p in parts} - set(by_rank))
    if missing:
        raise KVLayoutError(f"destination rank {dst.tp_rank} of {dst.tp_size} reads from source rank(s) {missing}, "
                            "whose descriptions were not given")
    s_slots, d_slots = _slots(src_slots, dst_slots, min(by_rank[p[0]].slots for p in parts), dst.slots)
    at = dst.split if dst.split is not None else 0
    unit = dst.itemsize * math.prod(dst.rank_shape()[at + 1:]) if dst.split is not None else \
        dst.itemsize * math.prod(dst.rank_shape())
    reads = []
    for rank in sorted({p[0] for p in parts}):
        a, b, n = [], [], []
        for _, s_off, d_off, length in (p for p in parts if p[0] == rank):
            a.append(_grid(by_rank[rank], s_slots, s_off))
            b.append(_grid(dst, d_slots, d_off))
            n.append(np.full(a[-1].size, length * unit, dtype=np.int64))
        order = np.argsort(np.concatenate(b), kind="stable")
        descs = merge(np.concatenate(a)[order], np.concatenate(b)[order], np.concatenate(n)[order],
                      (by_rank[rank].device_id, dst.device_id))
        _inside(descs, (by_rank[rank], dst))
        reads.append(Read(rank, *descs))
    return tuple(reads)


def _inside(descs: tuple[np.ndarray, np.ndarray], sides: tuple[StateDescription, StateDescription]) -> None:
    for rows, d in zip(descs, sides, strict=True):
        if len(rows) and (rows[:, 0].min() < d.address or (rows[:, 0] + rows[:, 1]).max() > d.address + d.span):
            raise KVLayoutError(f"{d}: a descriptor would fall outside the tensor ({d.span} bytes at {d.address})")


__all__ = ["Piece", "StateDescription", "check_state_pair", "describe_state", "pieces", "plan_state"]
