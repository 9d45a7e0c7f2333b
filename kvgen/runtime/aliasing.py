"""Inputs whose memory aliases: the checks a connector runs before it writes anything.

Two destination elements at one address let one token overwrite another; a source that
shares memory with the destination can be overwritten before it is read. Each check here
is a named function so a bench can time it: per call they cost a few microseconds per
tensor and one sort of the slots a load writes.

Memory is compared by device and byte range. Where two ranges meet, tensors with the same
dtype and strides are compared element by element (exactly, by the arithmetic below), after
merging each dim that steps exactly over the next, so views that shape one dense page otherwise
(vLLM's SHUFFLE K and V tiles under LBHNC) compare as (block, page); any other meeting ranges
count as shared, since telling them apart would cost more than the copy. That refuses only
layouts no engine hands out (two views of different strides interleaved in one buffer).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvgen.runtime import native
from kvgen.runtime.errors import KVLayoutError

#: (stride, size) of each dim with more than one element, largest stride first.
Dims = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Extent:
    """Where a tensor's elements lie: bytes [lo, hi) on `device`, and its strides. Holds no
    tensor, so a cached binding keeps no cache alive."""

    device: torch.device
    lo: int
    hi: int
    item: int
    dims: Dims

    def meets(self, other: Extent) -> bool:
        return self.device == other.device and self.lo < other.hi and other.lo < self.hi


def extent(t: torch.Tensor) -> Extent:
    dims = _coalesced(sorted(((s, n) for n, s in zip(t.shape, t.stride(), strict=True) if n > 1), reverse=True))
    lo = t.data_ptr()
    if t.numel() == 0:
        return Extent(t.device, lo, lo, t.element_size(), dims)
    last = sum((n - 1) * s for s, n in dims)
    return Extent(t.device, lo, lo + (last + 1) * t.element_size(), t.element_size(), dims)


def _coalesced(dims: list[tuple[int, int]]) -> Dims:
    """`dims` (largest stride first) with each dim that steps exactly over the one below it merged
    into it: the same element offsets, so two views that tile one dense page differently (AITER's
    K [H, C/x, N, x] and V [H, N/x, C, x] pages) have equal dims and are compared element by element."""
    out: list[tuple[int, int]] = []
    for stride, size in reversed(dims):
        if out and stride == out[-1][0] * out[-1][1]:
            out[-1] = (out[-1][0], out[-1][1] * size)
        else:
            out.append((stride, size))
    return tuple(reversed(out))


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last) of `t`'s elements; the cheap part of `extent`."""
    lo = t.data_ptr()
    if t.numel() == 0:
        return lo, lo
    if t.is_contiguous():
        return lo, lo + t.numel() * t.element_size()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return lo, lo + (last + 1) * t.element_size()


def storage_reach(t: torch.Tensor) -> int:
    """Bytes of its storage that `t`'s view reaches: from the storage's start to one past its
    last element (strides are never negative in torch)."""
    nbytes = t.nbytes
    if nbytes == 0:
        return 0
    if t.is_contiguous():
        return t.storage_offset() * t.element_size() + nbytes
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def within_storage(t: torch.Tensor) -> bool:
    """Whether `t`'s view stays inside its storage (check_storage says why not; this is its cheap test)."""
    return storage_reach(t) <= t.untyped_storage().nbytes()


def check_storage(t: torch.Tensor, name: str, outcome: str = "nothing was moved") -> None:
    """Refuse a tensor whose view reaches past its storage: a storage shrunk after the view
    was made (`untyped_storage().resize_()`, as engines free KV memory in sleep modes) would
    let a kernel read or write bytes that are no longer the tensor's. `outcome` ends the
    message (what the refused call has moved). A few attribute reads."""
    have, need = t.untyped_storage().nbytes(), storage_reach(t)
    if need > have:
        raise KVLayoutError(f"{name}: its storage holds {have} bytes, but the view reaches {need} (storage offset "
                            f"{t.storage_offset()}, shape {list(t.shape)}, strides {list(t.stride())}); its memory "
                            f"was freed or resized after the view was made: {outcome}")


def check_plain(t: torch.Tensor, name: str) -> None:
    """Refuse a lazily negated or conjugated view (torch._neg_view, .conj()): its bytes are
    not its values, and the copies move bytes, so the sign would be lost."""
    if t.is_neg():
        raise KVLayoutError(f"{name} is a negated view (torch._neg_view: its bytes hold the negation of its "
                            "values, applied on read); pass t.resolve_neg(), whose bytes are its values")
    if t.is_conj():
        raise KVLayoutError(f"{name} is a conjugated view (its bytes hold the conjugate of its values, applied "
                            "on read); pass t.resolve_conj(), whose bytes are its values")


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two indices of `t` may address one element (a sufficient test: False proves
    they never do). Sorted by stride, each dim must step past everything the smaller dims
    reach; `as_strided` views that fold back on themselves fail it, stride 0 included."""
    if t.numel() <= 1 or t.is_contiguous():
        return False
    reach = 0  # the largest offset, in elements, that the dims seen so far can make
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride(), strict=True) if n > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def share_elements(a: Extent, b: Extent) -> bool:
    """Whether `a` and `b` may have an element in common (exact for equal dtype and strides)."""
    if not a.meets(b) or a.lo == a.hi or b.lo == b.hi:
        return False
    if a.item != b.item or a.dims != b.dims:
        return True
    delta, rest = divmod(b.lo - a.lo, a.item)
    return bool(rest) or _difference(delta, a.dims)


def _difference(delta: int, dims: Dims) -> bool:
    """Whether `delta` = sum(k * stride) with |k| < size per dim: the offset between two
    elements of one strided layout. With non-overlapping strides at most two values of k
    fit each dim, so the search stays small; a wider one gives up and says True."""
    tails = [0] * (len(dims) + 1)
    for i in range(len(dims) - 1, -1, -1):
        stride, size = dims[i]
        tails[i] = tails[i + 1] + (size - 1) * stride

    def search(d: int, i: int) -> bool:
        if i == len(dims):
            return d == 0
        if abs(d) > tails[i]:
            return False
        stride, size = dims[i]
        lo = max(-(size - 1), -((tails[i + 1] - d) // stride))  # ceil((d - tail) / stride)
        hi = min(size - 1, (d + tails[i + 1]) // stride)
        if hi - lo > 2:
            return True
        return any(search(d - k * stride, i + 1) for k in range(lo, hi + 1))

    return search(delta, 0)


# -- the cache ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheMemory:
    """The cache's leaves as extents, and their union as sorted disjoint byte ranges per
    device, so an object is compared with the whole cache by one binary search."""

    leaves: tuple[Extent, ...]
    union: dict[torch.device, tuple[list[int], list[int]]]

    def leaves_meeting(self, device: torch.device, lo: int, hi: int) -> list[int]:
        ranges = self.union.get(device)
        if ranges is None or lo == hi:
            return []
        starts, ends = ranges
        i = bisect.bisect_right(starts, lo) - 1
        hit = (i >= 0 and ends[i] > lo) or (i + 1 < len(starts) and starts[i + 1] < hi)
        if not hit:
            return []
        return [k for k, leaf in enumerate(self.leaves) if leaf.device == device and leaf.lo < hi and lo < leaf.hi]


def check_cache_memory(leaves: Sequence[torch.Tensor], names: Sequence[str],
                       overlaid: Sequence[int] = ()) -> CacheMemory:
    """Refuse a cache tensor whose view reaches past its storage, a negated view, one that
    overlaps itself, or two cache tensors with an element in common (the same tensor twice,
    say); tensors that interleave in one buffer without sharing an element (per-layer views
    of one allocation) are fine. `overlaid`: where the leaves of overlaid groups start (a model
    whose groups share one allocation): two leaves of different groups may then share elements,
    two of one group still may not. Runs once per binding."""
    for t, name in zip(leaves, names, strict=True):
        check_storage(t, f"cache tensor {name}")
        check_plain(t, f"cache tensor {name}")
    extents = tuple(extent(t) for t in leaves)
    for t, name in zip(leaves, names, strict=True):
        if overlaps_itself(t):
            raise KVLayoutError(f"cache tensor {name} may address one element twice (shape {list(t.shape)}, "
                                f"strides {list(t.stride())}): distinct slots would share memory")
    bounds = [*overlaid, len(leaves)] if overlaid else [0, len(leaves)]
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        if lo < hi:
            _refuse_shared_leaves(extents[lo:hi], names[lo:hi])
    return CacheMemory(extents, _union(extents))


def _shares(a: Extent, b: Extent, seen: dict[tuple[int, Dims], bool]) -> bool:
    """Whether two leaves share an element; leaves of equal layout at one distance answer alike (`seen`)."""
    memo = (b.lo - a.lo, b.dims) if b.dims == a.dims and b.item == a.item else None
    if memo is None:
        return share_elements(a, b)
    if memo not in seen:
        seen[memo] = share_elements(a, b)
    return seen[memo]


def _refuse_shared_leaves(extents: Sequence[Extent], names: Sequence[str]) -> None:
    """Two cache leaves with an element in common: a sweep over the leaves by start address."""
    order = sorted(range(len(extents)), key=lambda k: extents[k].lo)
    open_: list[int] = []  # leaves whose range reaches past the current one's start
    seen: dict[tuple[int, Dims], bool] = {}
    for k in order:
        e = extents[k]
        open_ = [j for j in open_ if extents[j].hi > e.lo]
        for j in open_:
            if extents[j].meets(e) and _shares(extents[j], e, seen):
                a, b = sorted((j, k))
                same = "are the same memory" if extents[j] == e else "share memory"
                raise KVLayoutError(f"cache tensors {names[a]} and {names[b]} {same}: a write to one would change "
                                    "the other; pass one tensor per cache entry")
        open_.append(k)


def _union(extents: Sequence[Extent]) -> dict[torch.device, tuple[list[int], list[int]]]:
    out: dict[torch.device, tuple[list[int], list[int]]] = {}
    for e in sorted((e for e in extents if e.lo < e.hi), key=lambda e: e.lo):
        starts, ends = out.setdefault(e.device, ([], []))
        if ends and e.lo <= ends[-1]:
            ends[-1] = max(ends[-1], e.hi)
        else:
            starts.append(e.lo)
            ends.append(e.hi)
    return out


# -- memory objects -------------------------------------------------------------------------------


def check_objects_apart(tensors: Sequence[torch.Tensor], name: Callable[[int], str], cache: CacheMemory,
                        cache_names: Sequence[str]) -> None:
    """Refuse object tensors whose view reaches past their storage, negated views, tensors that
    overlap themselves, each other, or the cache. `name(k)` says which object tensors[k] is ("for chunk 1"); it
    is called only for a message."""
    ranges = []
    for k, t in enumerate(tensors):
        lo, hi = _object_range(t, k, name)
        for leaf in cache.leaves_meeting(t.device, lo, hi):
            if share_elements(cache.leaves[leaf], extent(t)):
                raise KVLayoutError(f"memory object {name(k)} shares memory with cache tensor {cache_names[leaf]}: "
                                    "a transfer would overwrite what it reads; copy the object out of the cache")
        if lo < hi:
            ranges.append((lo, hi, t.device, k))
    if len(ranges) >= 2:
        _refuse_shared_objects(ranges, tensors, name)


def _object_range(t: torch.Tensor, k: int, name: Callable[[int], str]) -> tuple[int, int]:
    """The byte range of object tensor `k`, refused when its view reaches past its storage, is
    negated, or overlaps itself."""
    if t.is_neg() or t.is_conj() or not within_storage(t):
        check_storage(t, f"memory object {name(k)}")
        check_plain(t, f"memory object {name(k)}")
    if t.is_contiguous():  # the usual object: no overlap with itself, one byte range
        lo = t.data_ptr()
        return lo, lo + t.nbytes
    if overlaps_itself(t):
        raise KVLayoutError(f"memory object {name(k)} may address one element twice (shape {list(t.shape)}, "
                            f"strides {list(t.stride())}): distinct tokens would share memory; pass a tensor "
                            "with its own storage")
    return _byte_range(t)


def _refuse_shared_objects(ranges: list[tuple[int, int, torch.device, int]], tensors: Sequence[torch.Tensor],
                           name: Callable[[int], str]) -> None:
    """Two object tensors with an element in common: a sweep over their byte ranges by start."""
    ranges.sort(key=lambda r: r[0])
    open_: list[tuple[int, int, torch.device, int]] = []
    for r in ranges:
        open_ = [o for o in open_ if o[1] > r[0]]
        for o in open_:
            if o[2] == r[2] and share_elements(extent(tensors[o[3]]), extent(tensors[r[3]])):
                a, b = sorted((o[3], r[3]))
                same = "are the same memory" if (o[0], o[1]) == (r[0], r[1]) else "share memory"
                raise KVLayoutError(f"memory objects {name(a)} and {name(b)} {same}: each chunk (and layer) needs "
                                    "its own object")
        open_.append(r)


# -- slots ------------------------------------------------------------------------------------------


def check_unique_slots(slot_mapping: torch.Tensor, windows: Sequence[tuple[int, int]], offset: int) -> None:
    """Refuse a load that writes one slot from two tokens (whichever came last would win).
    `windows` are the [first, end) token positions each chunk moves; slots < 0 move nothing.
    One sort and one host sync per call."""
    parts = [slot_mapping[lo - offset:hi - offset] for lo, hi in windows if hi > lo]
    if not parts:
        return
    slots = torch.cat(parts) if len(parts) > 1 else parts[0]
    slot = _repeated_slot(slots)
    if slot is None:
        return
    tokens = [i for lo, hi in windows for i in range(lo, hi) if int(slot_mapping[i - offset]) == slot]
    raise KVLayoutError(f"slot {slot} is written by more than one token of this load (tokens {tokens}): only one "
                        "would survive; give each token its own slot, or -1 to skip it")


def _repeated_slot(slots: torch.Tensor) -> int | None:
    """A slot >= 0 that two entries of `slots` hold, or None: one C pass over the sorted slots on
    the CPU where the compiled kernel is loaded, else a sort with tensor ops."""
    lib = native.library() if slots.device.type == "cpu" else None
    if lib is not None:
        flat = slots.to(torch.int64).contiguous()
        scratch = torch.empty_like(flat)  # held until the call returns: the kernel writes into it
        found = lib.kvgen_repeated_slot(flat.data_ptr(), flat.numel(), scratch.data_ptr())
        return None if found < 0 else found
    slots = slots[slots >= 0]
    if slots.numel() < 2:
        return None
    ordered = torch.sort(slots).values
    repeated = ordered[1:] == ordered[:-1]
    if not bool(repeated.any()):
        return None
    return int(ordered[1:][repeated][0])
