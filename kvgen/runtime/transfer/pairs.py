"""Per-call slot work of a layout-to-layout transfer, done once and shared by every layer.

Token i moves from source slot `src_slots[i]` to destination slot `dst_slots[i]`; a token with
a slot < 0 on either side is skipped. What moves is a set of (source slot, destination slot)
pairs, so the pairs are sorted by destination slot (one sort, which also finds a destination
slot written twice) and split into:

* a block path: runs of N pairs that fill a whole source block and a whole destination block,
  in order (same block size N on both sides), moved a block at a time; the block ids become a
  slice when they are consecutive (one plain copy);
* a token path: every other pair, by (block, offset) on block-addressed sides or by row on a
  folded slot axis (a slice when those rows are consecutive).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.layout import Geometry
from kvgen.runtime.ops import put_index

Index = torch.Tensor | slice


@dataclass(frozen=True)
class Side:
    """One side's indices: block ids of the block path; slots, or blocks and offsets, of the token path."""

    blocks: Index | None
    slots: Index | None
    blk: torch.Tensor | None
    off: torch.Tensor | None


class Scratch:
    """Reusable gather buffers of one thread's whole copies, or of one layerwise generator: a
    gathered chunk goes into memory that is already mapped, instead of a fresh allocation per
    layer (on a CPU, first-touch page faults of fresh buffers cost as much as the copy). One
    buffer per device; each use ends (its values consumed) before the next begins."""

    def __init__(self) -> None:
        self.buffers: dict[torch.device, torch.Tensor] = {}

    def take(self, shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        need = math.prod(shape) * like.element_size()
        buffer = self.buffers.get(like.device)
        if buffer is None or buffer.numel() < need:
            buffer = self.buffers[like.device] = torch.empty(need, dtype=torch.uint8, device=like.device)
        return buffer[:need].view(like.dtype).view(tuple(shape))


@dataclass(frozen=True)
class Pairs:
    """What one transfer call moves; immutable, so threads never share a half-made one."""

    moved: int
    src: Side
    dst: Side
    #: Head ranges: source heads [src_h, src_h + heads) go to [dst_h, dst_h + heads).
    src_h: int
    dst_h: int
    heads: int
    has_blocks: bool
    has_tokens: bool
    scratch: Scratch | None = None
    #: Slots per block of the block path (a folded side is split into blocks of this size).
    block: int = 0

    # The generated copies read these names.
    @property
    def src_blocks(self) -> Index | None:
        return self.src.blocks

    @property
    def dst_blocks(self) -> Index | None:
        return self.dst.blocks

    @property
    def src_slots(self) -> Index | None:
        return self.src.slots

    @property
    def dst_slots(self) -> Index | None:
        return self.dst.slots

    @property
    def src_blk(self) -> torch.Tensor | None:
        return self.src.blk

    @property
    def src_off(self) -> torch.Tensor | None:
        return self.src.off

    @property
    def dst_blk(self) -> torch.Tensor | None:
        return self.dst.blk

    @property
    def dst_off(self) -> torch.Tensor | None:
        return self.dst.off


_NONE = Side(None, None, None, None)


def _run(ids: torch.Tensor) -> Index:
    """`ids` as a slice when they are consecutive and ascending (one plain copy), else as they are."""
    first, last = (int(v) for v in torch.stack([ids[0], ids[-1]]).tolist())
    if last - first == ids.numel() - 1 and torch.equal(ids, torch.arange(first, last + 1, device=ids.device)):
        return slice(first, last + 1)
    return ids


def _side(slots: torch.Tensor, block_ids: torch.Tensor | None, g: Geometry, device: torch.device) -> Side:
    blocks = None if block_ids is None or block_ids.numel() == 0 else _run(block_ids.to(device))
    if slots.numel() == 0:
        return Side(blocks, None, None, None)
    slots = slots.to(device)
    if g.N is None:  # a folded slot axis: rows by slot
        return Side(blocks, _run(slots), None, None)
    return Side(blocks, _run(slots), slots // g.N, slots % g.N)


def pair_slots(src_slots: torch.Tensor, dst_slots: torch.Tensor, gs: Geometry, gd: Geometry,
               heads: tuple[int, int, int]) -> Pairs:
    """The pairs of one call; KVLayoutError for a slot outside its cache or a destination slot
    written by two tokens. The slot tensors are 1-D integer tensors of equal length."""
    work = src_slots.device if src_slots.device == dst_slots.device else torch.device("cpu")
    s, d = src_slots.to(work).long(), dst_slots.to(work).long()
    empty = Pairs(0, _NONE, _NONE, *heads, False, False)
    if s.numel() == 0:
        return empty
    s_hi, d_hi = torch.stack([s.max(), d.max()]).tolist()  # one host sync
    for what, high, g in (("src_slots", s_hi, gs), ("dst_slots", d_hi, gd)):
        if high >= g.S:
            raise KVLayoutError(f"{what}: slot {high} is outside its cache, which has {g.S} slots (valid slots: "
                                f"0..{g.S - 1}, or < 0 to skip a token)")
    keep = (s >= 0) & (d >= 0)
    if not bool(keep.all()):
        s, d = s[keep], d[keep]
    m = s.numel()
    if m == 0:
        return empty
    d, order = torch.sort(d)
    s = s[order]
    twice = d[1:] == d[:-1]
    if bool(twice.any()):
        slot = int(d[1:][twice][0])
        tokens = ((dst_slots.to(work).long() == slot) & keep).nonzero().flatten().tolist()
        raise KVLayoutError(f"dst_slots: slot {slot} is written by more than one token (tokens {tokens}): only one "
                            "would survive; give each token its own destination slot, or -1 to skip it")
    n = _block_size(gs, gd)
    if n is None or m < n:
        return Pairs(m, _side(s, None, gs, gs.device), _side(d, None, gd, gd.device), *heads, False, True)
    # A block starts at pair p when both slots start a block and the next N - 1 pairs step by
    # one on both sides; such runs never overlap (each starts at a multiple of N).
    step = torch.zeros(m, dtype=torch.long, device=work)
    step[1:] = ((d[1:] - d[:-1] == 1) & (s[1:] - s[:-1] == 1)).long().cumsum(0)
    first = torch.arange(m - n + 1, device=work)
    whole = (d[first] % n == 0) & (s[first] % n == 0) & (step[first + n - 1] - step[first] == n - 1)
    starts = first[whole]
    if starts.numel() == 0:
        return Pairs(m, _side(s, None, gs, gs.device), _side(d, None, gd, gd.device), *heads, False, True)
    rest = torch.ones(m, dtype=torch.bool, device=work)
    rest[(starts[:, None] + torch.arange(n, device=work)).flatten()] = False
    src = _side(s[rest], s[starts] // n, gs, gs.device)
    dst = _side(d[rest], d[starts] // n, gd, gd.device)
    return Pairs(m, src, dst, *heads, True, src.slots is not None or src.blk is not None, block=n)


def _block_size(gs: Geometry, gd: Geometry) -> int | None:
    """The block size whole blocks move in: both sides' N when they agree; a folded side
    (N None) takes the other side's when it divides its slots; None: no block path."""
    if gs.N is None and gd.N is None:
        return None
    n = gs.N if gs.N is not None else gd.N
    assert n is not None
    for g in (gs, gd):
        if (g.N is not None and g.N != n) or g.S % n:
            return None
    return n


def carry(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`value` on the device of `like` (a transfer between a GPU cache and a host pool)."""
    return value if value.device == like.device else value.to(like.device)


def pick(x: torch.Tensor, dim: int, index: Index, scratch: Scratch | None = None) -> torch.Tensor:
    """x's entries `index` along `dim`: a view for a slice, else index_select (into scratch)."""
    if isinstance(index, slice):
        return x.narrow(dim, index.start, index.stop - index.start)
    shape = list(x.shape)
    shape[dim] = index.numel()
    out = scratch.take(shape, x) if scratch is not None else x.new_empty(shape)
    # Over dim 0 of views: torch's CPU index_select over another dim of a strided tensor goes
    # element by element (measured 100x slower on a page-first host pool's layer view).
    torch.index_select(x.movedim(dim, 0), 0, index, out=out.movedim(dim, 0))
    return out


def _merged(x: torch.Tensor, b: int) -> torch.Tensor | None:
    """x with its dims b (blocks) and b + 1 (slots in a block) as one slot dim, when that is a view."""
    if x.stride(b) != x.shape[b + 1] * x.stride(b + 1):
        return None
    return x.view(*x.shape[:b], x.shape[b] * x.shape[b + 1], *x.shape[b + 2:])


def pick_slots(x: torch.Tensor, b: int, side: Side, scratch: Scratch | None = None) -> torch.Tensor:
    """The tokens of `side` from x, whose dims b and b + 1 are blocks and slots in a block: one
    index over the merged slot dim (a view for consecutive slots) where the strides allow."""
    merged = _merged(x, b)
    if merged is None:
        return x[(slice(None),) * b + (side.blk, side.off)]
    assert side.slots is not None
    return pick(merged, b, side.slots, scratch)


def put_slots(y: torch.Tensor, b: int, side: Side, value: torch.Tensor) -> None:
    """Write `value` (tokens at dim b) at the slots of `side` in y, as pick_slots reads them."""
    merged = _merged(y, b)
    if merged is None:
        y[(slice(None),) * b + (side.blk, side.off)] = value
    else:
        assert side.slots is not None
        put_index(merged, b, side.slots, value)


#: One side of a block move: (tensor, its block dim, the blocks).
Blocks = tuple[torch.Tensor, int, Index]


def move_blocks(src: Blocks, dst: Blocks, order: tuple[int, ...], scratch: Scratch | None = None) -> None:
    """For src = (x, dx, xs) and dst = (y, dy, ys): y's blocks `ys` (over dim dy) = x's blocks
    `xs` (over dim dx), x's dims permuted by `order` into y's: one pass when either side's
    blocks are consecutive (a view on that side), else a gather into scratch (memory already
    mapped, often still in cache) and a scatter. (One copy per block pair would be one pass
    too, but single-threaded per call: slower on a quiet CPU and far slower on a GPU.)"""
    (x, dx, xs), (y, dy, ys) = src, dst
    if isinstance(ys, slice) and not isinstance(xs, slice) and x.device == y.device:
        # Gather straight into y's consecutive blocks, seen in x's dim order.
        inverse = tuple(order.index(i) for i in range(len(order)))
        into = y.narrow(dy, ys.start, ys.stop - ys.start).permute(inverse)
        torch.index_select(x.movedim(dx, 0), 0, xs, out=into.movedim(dx, 0))  # over dim 0: see pick
        return
    part = pick(x, dx, xs, scratch).permute(order)
    if isinstance(ys, slice):
        y.narrow(dy, ys.start, ys.stop - ys.start).copy_(part)
    else:
        put_index(y, dy, ys, carry(part, y))
