"""Descriptors of one read: the byte runs that move given token pairs and heads from one
described cache into another, coalesced across every axis contiguous on both sides.

Each element axis the two caches share (L, KV, H narrowed to a head range, C) is a dim with
both sides' leaf step (list levels) and byte stride; the innermost dims both sides keep
contiguous merge into one run (as kvgen.runtime.transfer.compiled orders a kernel call). The
tokens are one more dim, placed among the others by the destination's within-block stride.
Every other dim, and the tokens, become descriptors on an index grid worked out at once;
neighbours that continue each other on both sides then merge (consecutive tokens of a block,
consecutive blocks, planes that follow each other).

The arithmetic is numpy's: one thread, so a plan of a few hundred thousand runs takes
milliseconds even on a host whose cores are busy (torch's small ops wait for a thread team).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from kvgen.remote.describe import GROUP, PLACE, CacheDescription
from kvgen.runtime.errors import KVLayoutError

#: A head range (start, stop) in a rank's local heads.
Heads = tuple[int, int]
#: Reads of up to this many descriptors before merging are cut for real to be costed (cheap);
#: larger ones are costed by that count, an upper bound.
EXACT = 1 << 16


@dataclass(frozen=True)
class RunDim:
    n: int
    src: tuple[int, int]  # (leaf step, byte stride)
    dst: tuple[int, int]


def _axis(d: CacheDescription, axis: str) -> tuple[int, int]:
    return d.step(axis), d.stride(axis)


def _token_offsets(d: CacheDescription, slots: np.ndarray) -> np.ndarray:
    """Bytes from a leaf's start to each slot's first element."""
    if d.block is None:
        return slots * d.stride("S")
    return (slots // d.block) * d.stride("B") + (slots % d.block) * d.stride("N")


def _group_size(src: CacheDescription, dst: CacheDescription) -> int:
    """Heads per group where a side holds its heads in groups (check_pair: both alike), else 1."""
    return src.group if src.grouped else dst.group


def _head_axes(d: CacheDescription, group: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(step, stride) of a head group and of a head within it: a side without groups steps
    `group` heads per group."""
    if d.grouped:
        return _axis(d, GROUP), _axis(d, PLACE)
    step, stride = _axis(d, "H")
    return (step * group, stride * group), (step, stride)


def _dims(src: CacheDescription, dst: CacheDescription, count: int) -> list[RunDim]:
    out = []
    group = _group_size(src, dst)
    for axis in ("L", "KV", "H", "C"):
        if axis == "H" and (src.grouped or dst.grouped):
            if count % group:  # plan() refuses such routes first (group_cut); this guards a call of layout()
                raise KVLayoutError(f"{src.spec} -> {dst.spec}: a read of {count} head(s) is not whole groups "
                                    f"of {group}; a cache in head groups moves whole groups")
            (s_group, s_head), (d_group, d_head) = _head_axes(src, group), _head_axes(dst, group)
            out += [RunDim(n, a, b) for n, a, b in ((count // group, s_group, d_group), (group, s_head, d_head))
                    if n > 1]
            continue
        n = count if axis == "H" else src.extent(axis)
        if n > 1:
            out.append(RunDim(n, _axis(src, axis), _axis(dst, axis)))
    return out


def _split(dims: list[RunDim], item: int) -> tuple[int, list[RunDim]]:
    """(run bytes, the dims left outside it, outermost first in the destination's order)."""
    dims = sorted(dims, key=lambda d: (-d.dst[0], -d.dst[1]))
    run = item
    while dims and all(side == (0, run) for side in (dims[-1].src, dims[-1].dst)):
        run *= dims.pop().n
    return run, dims


def _head_shift(d: CacheDescription, start: int) -> tuple[int, int]:
    if d.grouped:  # a head range of a cache in groups starts at a group
        if start % d.group:
            raise KVLayoutError(f"{d.spec}: a head range from head {start} cuts a group of {d.group} heads; "
                                "a cache in head groups moves whole groups")
        ls, bs = _axis(d, GROUP)
        return start // d.group * ls, start // d.group * bs
    ls, bs = _axis(d, "H")
    return start * ls, start * bs


def _segments(d: CacheDescription, s_desc: CacheDescription, pairs: tuple[np.ndarray, np.ndarray]
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source start slots, destination start slots, lengths) of the runs of pairs that step
    by one slot on both sides without crossing a block boundary on either."""
    s, t = pairs
    cut = np.ones(s.size, dtype=bool)
    cut[1:] = (s[1:] != s[:-1] + 1) | (t[1:] != t[:-1] + 1)
    for slots, desc in ((s, s_desc), (t, d)):
        if desc.block is not None:
            cut |= slots % desc.block == 0
    first = np.flatnonzero(cut)
    return s[first], t[first], np.diff(first, append=s.size)


@dataclass(frozen=True)
class Layout:
    """How one read is cut: the run both sides keep contiguous, the dims outside it (with
    the tokens at `at`), and the token runs (one per token, or per run of consecutive slots
    where a token's stride is the run on both sides)."""

    src: CacheDescription
    dst: CacheDescription
    heads: tuple[Heads, Heads]
    run: int
    outer: tuple[RunDim, ...]
    at: int
    tokens: tuple[np.ndarray, np.ndarray, np.ndarray]  # source slots, destination slots, lengths

    @property
    def count(self) -> int:
        """Descriptors before neighbours merge (an upper bound of the plan's count)."""
        n = self.tokens[0].size
        for d in self.outer:
            n *= d.n
        return n

    @property
    def bytes(self) -> int:
        n = int(self.tokens[2].sum()) * self.run
        for d in self.outer:
            n *= d.n
        return n

    @cached_property
    def descs(self) -> tuple[np.ndarray, np.ndarray]:
        """(src_descs, dst_descs), worked out once."""
        return descriptors(self)

    @cached_property
    def exact(self) -> int:
        """Descriptors after neighbours merge: len(descs[0]), worked out without them where it can."""
        return len(self.descs[0]) if "descs" in self.__dict__ else merged_count(self)

    @property
    def merged(self) -> int:
        """Descriptors after neighbours merge where that is cheap to know (see EXACT), else `count`."""
        return self.exact if self.count <= EXACT else self.count


def layout(src: CacheDescription, dst: CacheDescription, pairs: tuple[np.ndarray, np.ndarray],
           heads: tuple[Heads, Heads]) -> Layout:
    """The cut of a read moving source slot pairs[0][i] to destination slot pairs[1][i] (valid
    slots, sorted by destination slot), source heads heads[0] onto destination heads heads[1]."""
    count = heads[0][1] - heads[0][0]
    run, outer = _split(_dims(src, dst, count), src.itemsize)
    tok = [x.stride("N" if x.block else "S") for x in (src, dst)]
    if tok == [run, run]:  # consecutive slots continue each other: a run of them is one descriptor
        run_of = _segments(dst, src, pairs)
    else:
        run_of = (pairs[0], pairs[1], np.ones_like(pairs[0]))
    return Layout(src, dst, heads, run, tuple(outer), _at(dst, tuple(outer), run_of, tok[1]), run_of)


def _at(dst: CacheDescription, outer: tuple[RunDim, ...], run_of: tuple[np.ndarray, np.ndarray, np.ndarray],
        step: int) -> int:
    """Where the tokens go among the outer dims: outside every dim the destination steps over in
    less than one of them (`step`, its token stride), or than a whole destination block where
    every run of tokens is one (then the dims inside a block, such as HND's heads, follow each
    other and merge)."""
    if dst.block and run_of[2].size and bool((run_of[2] == dst.block).all() and (run_of[1] % dst.block == 0).all()):
        step = dst.stride("B")
    return next((k for k, d in enumerate(outer) if d.dst[0] == 0 and d.dst[1] < step), len(outer))


def parts(cut: Layout, reads: list[tuple[np.ndarray, np.ndarray]], bounds: list[tuple[int, int]]) -> list[Layout]:
    """layout(cut.src, cut.dst, reads[c], cut.heads) for each c, where reads[c] are the pairs of
    `cut` whose destination slots are in bounds[c] = [lo, hi) (ascending, apart): from `cut`'s own
    cut (its run and dims depend on the sides and heads alone) where no run of tokens crosses lo
    or hi, else made anew; where every one is such a slice with `cut`'s token place, their
    descriptors are worked out together (chunked_descriptors)."""
    s, t, n = cut.tokens
    step = cut.dst.stride("N" if cut.dst.block else "S")
    out, ranges = [], []
    for pairs, (lo, hi) in zip(reads, bounds, strict=True):
        i, j = (int(x) for x in np.searchsorted(t, (lo, hi)))
        if (i and t[i - 1] + n[i - 1] > lo) or (j and t[j - 1] + n[j - 1] > hi):
            out.append(layout(cut.src, cut.dst, pairs, cut.heads))
            continue
        run_of = (s[i:j], t[i:j], n[i:j])
        out.append(Layout(cut.src, cut.dst, cut.heads, cut.run, cut.outer, _at(cut.dst, cut.outer, run_of, step),
                          run_of))
        ranges.append((i, j))
    if len(ranges) == len(out) > 1 and all(x.at == cut.at for x in out):
        found = chunked_descriptors(cut, ranges)
        if found is not None:
            for x, descs in zip(out, found, strict=True):
                x.__dict__["descs"] = descs  # Layout.descs, worked out here (it is a cached_property)
    return out


def chunked_descriptors(cut: Layout, ranges: list[tuple[int, int]]) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """descriptors() of each slice [i, j) of `cut`'s token runs, as reads of their own, in one
    merge: every slice's grid (outer axes, its tokens, inner axes) one after the other, a run
    forced to start where each begins. None where the factored path does not apply."""
    inner = _inner(cut)
    if inner is None:
        return None
    tokens, lengths = _tokens(cut)
    shifts = _outer_shifts(cut)
    grids = [_repeat(_with_tokens(cut, inner, (tokens[0][i:j], tokens[1][i:j]), lengths[i:j]), shifts)
             for i, j in ranges]
    sizes = [g[0].size for g in grids]
    starts = np.cumsum([0, *sizes])
    a, b, nb = (np.concatenate([g[k] for g in grids]) for k in range(3))
    first_a, first_b, runs, first = _runs(a, b, nb, starts[:-1], True)
    at = np.searchsorted(first, starts)
    out = []
    for c in range(len(ranges)):
        lo, hi = at[c], at[c + 1]
        out.append(_descs(first_a[lo:hi], first_b[lo:hi], runs[lo:hi], (cut.src.device_id, cut.dst.device_id)))
    return out


def descriptors(cut: Layout) -> tuple[np.ndarray, np.ndarray]:
    """(src_descs, dst_descs): int64 [n, 3] tensors of (address, bytes, device id), matching
    row by row, of the read `cut` describes: the merge of every run of the index grid, worked
    out on a merged template of the inner axes tiled over the outer ones (see _Factored), or on
    the whole grid where the template would not be the same for every outer index."""
    f = _factored(cut)
    if f is None:
        return descriptors_flat(cut)
    a, b, sizes = f.tiled()
    return merge(a, b, sizes, (cut.src.device_id, cut.dst.device_id))


def merged_count(cut: Layout) -> int:
    """len(descriptors(cut)[0]), without making them where the template allows."""
    f = _factored(cut)
    return len(descriptors_flat(cut)[0]) if f is None else f.count()


@dataclass(frozen=True)
class _Factored:
    """A read's grid as inner axes (every axis from the tokens inwards that steps over no
    leaf, on either side: a shift of both addresses by one byte offset per index) and outer
    axes. Merging is shift-invariant, so the inner axes' runs merge once, into the template,
    and only the template's last run of one outer index can continue into the first of the
    next: tiling the merged template and merging again gives the whole grid's merge."""

    template: tuple[np.ndarray, np.ndarray, np.ndarray]  # merged: source, destination offsets, bytes
    shifts: tuple[np.ndarray, np.ndarray]  # each outer index's source and destination address

    def tiled(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return _repeat(self.template, self.shifts)

    def count(self) -> int:
        (ta, tb, tn), (sa, sb) = self.template, self.shifts
        if not ta.size:
            return 0
        joins = (sa[1:] + ta[0] == sa[:-1] + ta[-1] + tn[-1]) & (sb[1:] + tb[0] == sb[:-1] + tb[-1] + tn[-1])
        return sa.size * ta.size - int(joins.sum())


def _factored(cut: Layout) -> _Factored | None:
    """The template and shifts of `cut`, or None where the tokens are not inner (a leaf step
    inside them) or, with axes inside them, runs of tokens differ in length."""
    inner = _inner(cut)
    if inner is None:
        return None
    tokens, lengths = _tokens(cut)
    return _Factored(_with_tokens(cut, inner, tokens, lengths), _outer_shifts(cut))


def _tokens(cut: Layout) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    """The byte offsets of `cut`'s token runs on both sides, and the runs' lengths in tokens."""
    s_slots, d_slots, lengths = cut.tokens
    return (_token_offsets(cut.src, s_slots), _token_offsets(cut.dst, d_slots)), lengths


def _inner(cut: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The merged template of the axes inside the tokens (one run where there are none), or None
    where the factored path does not apply (see _factored)."""
    inner = cut.outer[cut.at:]
    lengths = cut.tokens[2]
    if any(d.src[0] or d.dst[0] for d in inner):
        return None
    if inner and lengths.size and bool((lengths != lengths[0]).any()):
        return None  # a guard: layout() puts axes inside the tokens only where every run is a whole block
    size = int(lengths[0]) * cut.run if inner and lengths.size else cut.run
    template = (np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), np.full(1, size, dtype=np.int64))
    for d in reversed(inner):  # innermost first: each axis repeats the merged axes inside it
        step = np.arange(d.n, dtype=np.int64)
        template = _tile(template, (step * d.src[1], step * d.dst[1]))
    return template


def _with_tokens(cut: Layout, inner: tuple[np.ndarray, np.ndarray, np.ndarray], tokens: tuple[np.ndarray, np.ndarray],
                 lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The template of the tokens (their byte offsets on both sides, their runs' lengths) and the
    axes inside them."""
    if cut.at < len(cut.outer):
        return _tile(inner, tokens)
    return _runs(*tokens, lengths * cut.run)  # the tokens alone: each run of them is as long as it is


def _outer_shifts(cut: Layout) -> tuple[np.ndarray, np.ndarray]:
    outer = cut.outer[:cut.at]
    return _shifts(cut.src, outer, 0, cut.heads[0][0]), _shifts(cut.dst, outer, 1, cut.heads[1][0])


def _repeat(template: tuple[np.ndarray, np.ndarray, np.ndarray], shifts: tuple[np.ndarray, np.ndarray]
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The template's runs repeated at each shift (outside it): source, destination, bytes."""
    (ta, tb, tn), (sa, sb) = template, shifts
    return (sa[:, None] + ta).reshape(-1), (sb[:, None] + tb).reshape(-1), \
        np.broadcast_to(tn, (sa.size, tn.size)).reshape(-1)


def _tile(template: tuple[np.ndarray, np.ndarray, np.ndarray], shifts: tuple[np.ndarray, np.ndarray]
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The template repeated at each shift (outside it), merged."""
    return _runs(*_repeat(template, shifts))


@lru_cache(maxsize=64)
def _shifts(desc: CacheDescription, outer: tuple[RunDim, ...], side: int, h0: int) -> np.ndarray:
    """The address each index of the outer axes shifts a run to (outermost first, flat; read-only:
    cached, since a staged plan's chunks and the sources of every plan ask the same)."""
    leaf_shift, byte_shift = _head_shift(desc, h0)
    leaf = np.full([1] * len(outer), leaf_shift, dtype=np.int64)
    off = np.full([1] * len(outer), byte_shift, dtype=np.int64)
    for j, d in enumerate(outer):
        grid = [1] * len(outer)
        grid[j] = d.n
        idx = np.arange(d.n, dtype=np.int64).reshape(grid)
        ls, bs = d.src if side == 0 else d.dst
        leaf, off = leaf + idx * ls, off + idx * bs
    out = (np.asarray(desc.leaves, dtype=np.int64)[leaf] + off).reshape(-1)
    out.flags.writeable = False
    return out


def descriptors_flat(cut: Layout) -> tuple[np.ndarray, np.ndarray]:
    """descriptors(cut) worked out on the whole index grid, one run per index (the reference
    the factored path is tested against, and its fallback)."""
    outer, at = cut.outer, cut.at
    s_slots, d_slots, lengths = cut.tokens
    shape = [d.n for d in outer]
    shape.insert(at, s_slots.size)
    view = [1] * len(shape)
    view[at] = -1
    addrs = []
    for k, (desc, slots, h0) in enumerate(((cut.src, s_slots, cut.heads[0][0]), (cut.dst, d_slots, cut.heads[1][0]))):
        leaf_shift, byte_shift = _head_shift(desc, h0)
        leaf = np.full([1] * len(shape), leaf_shift, dtype=np.int64)
        off = np.full([1] * len(shape), byte_shift, dtype=np.int64)
        for j, d in enumerate(outer):
            grid = [1] * len(shape)
            grid[j if j < at else j + 1] = d.n
            idx = np.arange(d.n, dtype=np.int64).reshape(grid)
            ls, bs = d.src if k == 0 else d.dst
            leaf, off = leaf + idx * ls, off + idx * bs
        base = np.asarray(desc.leaves, dtype=np.int64)[leaf]
        addrs.append(np.broadcast_to(base + off + _token_offsets(desc, slots).reshape(view), shape).reshape(-1))
    sizes = np.broadcast_to((lengths * cut.run).reshape(view), shape).reshape(-1)
    return merge(addrs[0], addrs[1], sizes, (cut.src.device_id, cut.dst.device_id))


def outside(descs: np.ndarray, d: CacheDescription) -> int:
    """How many descriptors of `descs` are not inside one leaf of `d` (leaf address, + span)."""
    if not len(descs):
        return 0
    bases = _sorted_leaves(d.leaves)
    at = np.searchsorted(bases, descs[:, 0], side="right") - 1
    ok = (at >= 0) & (descs[:, 0] + descs[:, 1] <= bases[np.maximum(at, 0)] + d.span)
    return int((~ok).sum())


@lru_cache(maxsize=64)
def _sorted_leaves(addresses: tuple[int, ...]) -> np.ndarray:
    out = np.sort(np.asarray(addresses, dtype=np.int64))
    out.flags.writeable = False
    return out


def merge(a: np.ndarray, b: np.ndarray, sizes: np.ndarray, devices: tuple[int, int]
           ) -> tuple[np.ndarray, np.ndarray]:
    """Neighbouring runs that continue each other on both sides, as one descriptor."""
    return _descs(*_runs(a, b, sizes), devices)


def _descs(a: np.ndarray, b: np.ndarray, lengths: np.ndarray, devices: tuple[int, int]
           ) -> tuple[np.ndarray, np.ndarray]:
    out = []
    for side, device in zip((a, b), devices, strict=True):
        desc = np.empty((side.size, 3), dtype=np.int64)
        desc[:, 0], desc[:, 1], desc[:, 2] = side, lengths, device
        out.append(desc)
    return out[0], out[1]


def _runs(a: np.ndarray, b: np.ndarray, sizes: np.ndarray, cuts: np.ndarray | None = None,
          where: bool = False) -> Any:
    """(source starts, destination starts, bytes) of the merged runs of a, b, sizes; a run starts
    at every index of `cuts` too; `where`: and the index each run starts at."""
    if a.size == 0:
        return (a, b, sizes, np.zeros(0, dtype=np.int64)) if where else (a, b, sizes)
    starts = np.empty(a.size + 1, dtype=bool)  # and one past the end: each run's bounds at once
    starts[0] = starts[-1] = True
    np.not_equal(a[1:], a[:-1] + sizes[:-1], out=starts[1:-1])
    starts[1:-1] |= b[1:] != b[:-1] + sizes[:-1]
    if cuts is not None:
        starts[cuts] = True
    bounds = starts.nonzero()[0]
    ends = np.empty(a.size + 1, dtype=np.int64)
    ends[0] = 0
    np.cumsum(sizes, out=ends[1:])
    first = bounds[:-1]
    found = a[first], b[first], ends[bounds[1:]] - ends[first]
    return (*found, first) if where else found


__all__ = ["EXACT", "Heads", "Layout", "descriptors", "descriptors_flat", "layout", "merge", "merged_count", "outside",
           "parts"]
