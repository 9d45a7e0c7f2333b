"""`plan`: the wire transfer that fills one destination rank's slots from the source ranks.

The routes come from kvgen.tp.plan (which source rank's heads land in which of this rank's
heads; MLA: one source per destination). Each route becomes one read of descriptors:

* direct: the destination's own bytes, read run by run from the source (kvgen.remote.runs);
* staged: the whole source blocks holding the tokens, read into a staging cache of the
  source's layout (long runs), then permuted locally into the destination by kvgen's
  generated transfer between the two layouts (the compiled kernel on a CPU).

A cost model (kvgen.remote.cost) picks the cheaper; `strategy=` forces one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np
import torch

from kvgen import generated, tp
from kvgen.remote.cost import Costs, costs
from kvgen.remote.describe import PLACE, CacheDescription, check_pair, describe, empty
from kvgen.remote.runs import EXACT, Heads, Layout, layout, outside, parts
from kvgen.runtime.binding import leaves
from kvgen.runtime.errors import KVLayoutError

STRATEGIES = ("direct", "staged")
#: A staged read is cut into up to this many chunks of consecutive source blocks, each with
#: its own staging and permute: a transport permutes chunk c while chunk c + 1 is read.
STAGE_CHUNKS = 4
#: Source blocks a chunk holds at least (smaller chunks cost more in calls than they overlap).
CHUNK_BLOCKS = 16


@dataclass(frozen=True)
class Read:
    """One read from one source rank: row i of src_descs lands at row i of dst_descs."""

    src_rank: int
    src_descs: np.ndarray  # int64 [n, 3]: address, bytes, device id (NIXL's get_xfer_descs takes it)
    dst_descs: np.ndarray
    #: The staging chunk this read fills (0 for a direct plan): Plan.finish(..., chunk=) after it.
    chunk: int = 0

    @property
    def bytes(self) -> int:
        return int(self.dst_descs[:, 1].sum()) if len(self.dst_descs) else 0


@dataclass(frozen=True)
class Staging:
    """A local permute after the reads: `caches` (the source's layout, filled by the reads) into
    the destination cache, by kvgen's generated transfer `pair`."""

    pair: tuple[str, str]
    caches: Any
    src_slots: torch.Tensor
    dst_slots: torch.Tensor
    src_heads: Heads
    dst_heads: Heads
    #: The chunk whose reads fill `caches`.
    chunk: int = 0


@dataclass(frozen=True)
class Plan:
    strategy: str
    why: str
    dst: CacheDescription
    reads: tuple[Read, ...]
    staging: tuple[Staging, ...] = ()

    @property
    def src_descs(self) -> np.ndarray:
        return np.concatenate([r.src_descs for r in self.reads]) if self.reads else np.empty((0, 3), dtype=np.int64)

    @property
    def dst_descs(self) -> np.ndarray:
        return np.concatenate([r.dst_descs for r in self.reads]) if self.reads else np.empty((0, 3), dtype=np.int64)

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.reads)

    @property
    def count(self) -> int:
        return sum(len(r.dst_descs) for r in self.reads)

    @property
    def chunks(self) -> tuple[int, ...]:
        """The chunks in order: after every read of chunk c, finish(..., chunk=c) may run while
        later chunks are read."""
        return tuple(sorted({r.chunk for r in self.reads} | {st.chunk for st in self.staging}))

    def finish(self, dst_caches: Any, chunk: int | None = None) -> None:
        """Run the staging permutes (of `chunk`, or all) into `dst_caches` (the cache `dst`
        describes), after the reads (of that chunk)."""
        if not self.staging:
            return
        found = tuple(t.data_ptr() for t in leaves(dst_caches))
        if found != self.dst.leaves:
            raise KVLayoutError(f"dst_caches are not the cache this plan was made for ({self.dst}): its tensors "
                                "start at other addresses")
        for st in self.staging:
            if chunk is None or st.chunk == chunk:
                _transfer(st.pair).copy(st.caches, st.src_slots, dst_caches, st.dst_slots,
                                        heads=tp.HeadRanges(st.src_heads, st.dst_heads))


_transfers: dict[tuple[str, str], Any] = {}


def _transfer(pair: tuple[str, str]) -> Any:
    found = _transfers.get(pair)
    if found is None:
        found = _transfers[pair] = generated.transfer(*pair)()
    return found


def _slots(what: str, slots: Any) -> np.ndarray:
    t = torch.as_tensor(slots)
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise KVLayoutError(f"{what} must be a 1-D tensor of signed integers, got {tuple(t.shape)} {t.dtype}")
    return t.cpu().long().numpy()


def _pairs(src_slots: Any, dst_slots: Any, src_s: int, dst: CacheDescription) -> tuple[np.ndarray, np.ndarray]:
    """The moving (source slot, destination slot) pairs, by destination slot; refusals name the slot."""
    s, d = _slots("src_slots", src_slots), _slots("dst_slots", dst_slots)
    if s.size != d.size:
        raise KVLayoutError(f"src_slots and dst_slots must have one slot per token: {s.size} and {d.size}")
    for what, v, high in (("src_slots", s, src_s), ("dst_slots", d, dst.extent("S"))):
        if v.size and int(v.max()) >= high:
            raise KVLayoutError(f"{what}: slot {int(v.max())} is outside its cache, which has {high} slots "
                                f"(valid: 0..{high - 1}, or < 0 to skip a token)")
    keep = (s >= 0) & (d >= 0)
    s, d = s[keep], d[keep]
    order = np.argsort(d, kind="stable")
    s, d = s[order], d[order]
    twice = d[1:] == d[:-1]
    if bool(twice.any()):
        raise KVLayoutError(f"dst_slots: slot {int(d[1:][twice][0])} is written by more than one token")
    return s, d


def _sources(src: CacheDescription | Sequence[CacheDescription], dst: CacheDescription) -> dict[int, CacheDescription]:
    given = [src] if isinstance(src, CacheDescription) else list(src)
    if not given:
        raise KVLayoutError("plan needs at least one source description")
    by_rank: dict[int, CacheDescription] = {}
    for d in given:
        if not isinstance(d, CacheDescription):
            raise KVLayoutError(f"sources must be kvgen.remote.CacheDescription objects, got {type(d).__name__}")
        check_pair(d, dst)
        if d.tp_size != given[0].tp_size or d.spec != given[0].spec:
            raise KVLayoutError(f"every source must share one layout and TP size: {given[0]} and {d}")
        by_rank[d.tp_rank] = d
    return by_rank


@dataclass(frozen=True)
class _Stage:
    """One route's staging: the whole source blocks of its tokens read into one staging cache
    (`caches`, described by `here`), then permuted into the destination."""

    src: CacheDescription
    here: CacheDescription
    caches: Any
    pair: tuple[str, str]
    blocks: np.ndarray  # the source blocks, ascending: staged block i is blocks[i]
    where: np.ndarray  # each token's staged block
    slots: tuple[np.ndarray, np.ndarray]  # each token's staged slot, destination slot
    heads: tuple[Heads, Heads, Heads]  # read from the source, read into the staging; permuted from

    def chunks(self, k: int, dst_heads: Heads) -> list[tuple[Layout, Staging]]:
        """The read and the permute cut into k chunks of consecutive staged blocks, each read and
        permuted on its own."""
        n = self.src.block or 1
        edges = np.linspace(0, self.blocks.size, k + 1).astype(np.int64)
        blocks = [(int(edges[c]), int(edges[c + 1])) for c in range(k)]
        reads = [((self.blocks[lo:hi, None] * n + np.arange(n)).reshape(-1), np.arange(lo * n, hi * n))
                 for lo, hi in blocks]
        cuts = parts(self.whole, reads, [(lo * n, hi * n) for lo, hi in blocks])  # staged slots of blocks lo..hi
        out = []
        for c, ((lo, hi), cut) in enumerate(zip(blocks, cuts, strict=True)):
            mine = (self.where >= lo) & (self.where < hi)
            out.append((cut, Staging(self.pair, self.caches, torch.from_numpy(self.slots[0][mine]),
                                     torch.from_numpy(self.slots[1][mine]), self.heads[2], dst_heads, c)))
        return out

    @cached_property
    def whole(self) -> Layout:
        """The read in one piece (what the cost model weighs)."""
        n = self.src.block or 1
        read = ((self.blocks[:, None] * n + np.arange(n)).reshape(-1), np.arange(self.blocks.size * n))
        return layout(self.src, self.here, read, self.heads[:2])


_shapes: dict[tuple[Any, ...], CacheDescription] = {}


def _described(caches: Any, s: CacheDescription, ext: tuple[tuple[str, int], ...], device_id: int) -> CacheDescription:
    """describe() of a staging cache `empty` made of s's layout with extents `ext`: what it reads
    from the tensors (geometry, strides, span) is the same for every cache of those extents, so
    it is read once per extents and the leaves' addresses put in."""
    key = (s.spec, s.dtype, ext, s.tp_rank, s.tp_size, s.num_kv_heads, device_id)
    found = _shapes.get(key)
    if found is None:
        if len(_shapes) >= 256:  # block counts vary by request: keep the cache bounded
            _shapes.clear()
        found = _shapes[key] = describe(caches, s.spec, tp_rank=s.tp_rank, tp_size=s.tp_size,
                                        num_kv_heads=s.num_kv_heads, device_id=device_id)
        return found
    return replace(found, leaves=tuple(t.data_ptr() for t in leaves(caches)))


def _staged(s: CacheDescription, dst: CacheDescription, pairs: tuple[np.ndarray, np.ndarray], route: tp.Route,
            narrow: bool) -> _Stage:
    """The route's staging: with every head of the source rank, or (`narrow`) only the route's."""
    s_slots, d_slots = pairs
    n = s.block or 1
    blocks, where = np.unique(s_slots // n, return_inverse=True)
    where = where.reshape(-1)
    heads = route.count if narrow else s.extent("H")
    ext = {"L": s.extent("L"), "KV": s.extent("KV"), "H": heads, "C": s.extent("C")}
    ext.update({"B": blocks.size, "N": n, "S": blocks.size * n} if s.block else {"S": blocks.size})
    if s.grouped:
        ext[PLACE] = s.group
    caches = empty(s.spec, ext, getattr(torch, s.dtype))
    here = _described(caches, s, tuple(ext.items()), dst.device_id)
    read = (route.src_heads, (0, heads)) if narrow else ((0, heads), (0, heads))
    return _Stage(s, here, caches, (s.spec, dst.spec), blocks, where, (where * n + s_slots % n, d_slots),
                  (*read, (0, heads) if narrow else route.src_heads))


def _cheaper_staging(s: CacheDescription, dst: CacheDescription, pairs: tuple[np.ndarray, np.ndarray], route: tp.Route,
                     c: Costs) -> _Stage:
    """Staging every head of the source rank (whole blocks: the longest runs) or only the
    route's (fewer bytes; runs as long where the heads are outside the tokens, as in HND)."""
    whole = _staged(s, dst, pairs, route, False)
    if s.mla or route.count == s.extent("H"):
        return whole
    narrow = _staged(s, dst, pairs, route, True)
    return min((whole, narrow), key=lambda st: c.read(*_estimate([st.whole], exact=True)))


def _routes(sources: dict[int, CacheDescription], dst: CacheDescription) -> list[tp.Route]:
    first = next(iter(sources.values()))
    routes = [r for r in tp.plan(dst.num_kv_heads, first.tp_size, dst.tp_size, mla=dst.mla)
              if r.dst_rank == dst.tp_rank]
    missing = sorted({r.src_rank for r in routes} - set(sources))
    if missing:
        raise KVLayoutError(f"destination rank {dst.tp_rank} of {dst.tp_size} reads from source ranks "
                            f"{sorted({r.src_rank for r in routes})} of {first.tp_size}; no description of "
                            f"rank(s) {missing} was given")
    for r in routes:  # before any staging is allocated or any read is made, whatever the strategy
        why = group_cut(r, (first.spec, dst.spec), (first.group, dst.group))
        if why:
            raise KVLayoutError(why)
    return routes


def group_cut(route: tp.Route, specs: tuple[str, str], groups: tuple[int, int]) -> str | None:
    """Why `route` cannot move between caches holding their heads in groups of groups[0] (source)
    and groups[1] (destination) heads (1: whole heads): a range of heads that starts or ends
    inside a group; None where every range is whole groups."""
    for side, spec, rank, (start, stop), g in (("source", specs[0], route.src_rank, route.src_heads, groups[0]),
                                               ("destination", specs[1], route.dst_rank, route.dst_heads, groups[1])):
        if start % g or stop % g:
            heads = f"head {start}" if stop - start == 1 else f"heads {start}..{stop - 1}"
            return (f"{spec}: {side} rank {rank}'s {heads} of route {route.src_rank} -> "
                    f"{route.dst_rank} cut its groups of {g} heads; a cache in head groups moves whole groups "
                    "(choose TP sizes that give each rank whole groups of the routes' heads)")
    return None


def _moved_bytes(dst: CacheDescription, tokens: int, routes: list[tp.Route]) -> int:
    per_head = dst.extent("L") * dst.extent("KV") * dst.extent("C") * dst.itemsize
    return tokens * per_head * sum(r.count for r in routes)


def plan(src: CacheDescription | Sequence[CacheDescription], dst: CacheDescription, src_slots: Any, dst_slots: Any, *,
         strategy: str | None = None, cost: Costs | None = None) -> Plan:
    """The reads (and staging permutes) that move token i from source slot src_slots[i] to
    destination slot dst_slots[i] on destination rank `dst`, from the source ranks `src` (one
    description, or one per rank; every rank the TP routes need). Slots < 0 skip a token.
    `strategy`: "direct", "staged" or None (the cost model's choice). KVLayoutError, before
    anything is allocated for the plan, for mismatched descriptions, slots or strategies."""
    if strategy is not None and strategy not in STRATEGIES:
        raise KVLayoutError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))} or None, got {strategy!r}")
    sources = _sources(src, dst)
    if dst.parts:
        return _plan_parts(sources, dst, src_slots, dst_slots, strategy)
    return _plan_one(sources, dst, (src_slots, dst_slots), strategy, cost)


def _plan_one(sources: dict[int, CacheDescription], dst: CacheDescription, slots: tuple[Any, Any],
              strategy: str | None, cost: Costs | None) -> Plan:
    """plan() of a single-part cache."""
    src_slots, dst_slots = slots
    routes = _routes(sources, dst)
    pairs = _pairs(src_slots, dst_slots, min(sources[r.src_rank].extent("S") for r in routes), dst)
    pair = (next(iter(sources.values())).spec, dst.spec)
    stageable = pair in generated.TRANSFERS  # keyed by spec names, as descriptions carry them
    if strategy == "staged" and not stageable:
        raise KVLayoutError(f"strategy 'staged' needs a generated transfer {pair[0]} -> {pair[1]} for the local "
                            "permute; declare it in a transfers.yaml and build, or use strategy='direct'")
    c = cost or costs()
    direct = [layout(sources[r.src_rank], dst, pairs, (r.src_heads, r.dst_heads)) for r in routes] \
        if strategy != "staged" else []
    if strategy == "direct" or not stageable or not pairs[0].size:
        why = "forced" if strategy == "direct" else \
            f"no generated transfer {pair[0]} -> {pair[1]} to stage through" if not stageable else "nothing moves"
        return _made("direct", why, dst, direct)
    stages = [(_cheaper_staging(sources[r.src_rank], dst, pairs, r, c), r.dst_heads) for r in routes]
    return _choose(direct, stages, dst, c, _moved_bytes(dst, pairs[0].size, routes))


def _plan_parts(sources: dict[int, CacheDescription], dst: CacheDescription, src_slots: Any, dst_slots: Any,
                strategy: str | None) -> Plan:
    """A cache of several parts: each part planned direct as a cache of its own leaves, every
    part's reads in one plan (the parts of one token move together)."""
    if strategy == "staged":
        raise KVLayoutError(f"{dst.spec} has several parts ({', '.join(p.part for p in dst.parts)}): its parts are "
                            "read direct (no generated transfer permutes one part); use strategy='direct' or None")
    first = next(iter(sources.values()))
    headless = [p.part for p in dst.parts if p.mla]
    if headless and len(headless) < len(dst.parts) and first.tp_size != dst.tp_size:
        raise KVLayoutError(f"{dst.spec}: part(s) {', '.join(headless)} hold no heads while its other parts do: "
                            f"each TP rank's values are its own, so they do not move from TP {first.tp_size} to "
                            f"TP {dst.tp_size}")
    made = [plan([s.parts[k] for s in sources.values()], part, src_slots, dst_slots, strategy="direct")
            for k, part in enumerate(dst.parts)]
    why = f"{'forced; ' if strategy == 'direct' else ''}each of its {len(made)} parts read direct"
    return Plan("direct", why, dst, tuple(r for p in made for r in p.reads))


def _choose(direct: list[Layout], stages: list[tuple[_Stage, Heads]], dst: CacheDescription, c: Costs,
            moved: int) -> Plan:
    """The cheaper of the direct reads and the staged ones (staged alone when direct is empty:
    forced), by the cost model, with both estimates in the plan's why; a staged plan's reads
    and permutes cut into chunks (STAGE_CHUNKS) once it is chosen."""
    cuts = [st.whole for st, _ in stages]
    # Staged reads are counted after merging, however many (here and in _cheaper_staging): they
    # read the source's own layout into a buffer of it, where whole blocks merge into a few long
    # descriptors, so the count before merging (131072 where 27328 are read, vLLM HND -> NHD at
    # 2048 tokens) would make direct reads of a 4x slower plan look cheaper.
    t_staged = c.read(*_estimate(cuts, exact=True)) + c.permute(len(stages), moved)
    k = max(1, min(STAGE_CHUNKS, min(st.blocks.size for st, _ in stages) // CHUNK_BLOCKS))
    if not direct:
        return _staged_plan(f"forced; estimated {t_staged * 1e3:.3f} ms", dst, stages, k)
    t_direct = c.read(*_estimate(direct))
    words = f"direct {_words(direct)}, est. {t_direct * 1e3:.3f} ms; staged {_words(cuts, exact=True)} + " \
        f"{len(stages)} local permutes, est. {t_staged * 1e3:.3f} ms"
    if t_direct <= t_staged:
        return _made("direct", words, dst, direct)
    return _staged_plan(words, dst, stages, k)


def _staged_plan(why: str, dst: CacheDescription, stages: list[tuple[_Stage, Heads]], k: int) -> Plan:
    made = [m for st, heads in stages for m in st.chunks(k, heads)]
    return _made("staged", why + (f"; read and permuted in {k} chunks" if k > 1 else ""), dst, [m[0] for m in made],
                 tuple(m[1] for m in made))


def _estimate(cuts: list[Layout], *, exact: bool = False) -> tuple[int, int]:
    """(descriptors, bytes) of reads cut so: merged, where their descriptors before merging are
    at most EXACT together (cheap to cut for real) or `exact` asks, else that count (an upper bound)."""
    exact = exact or sum(x.count for x in cuts) <= EXACT
    return sum(x.exact if exact else x.count for x in cuts), sum(x.bytes for x in cuts)


def _words(cuts: list[Layout], *, exact: bool = False) -> str:
    count, nbytes = _estimate(cuts, exact=exact)
    exact = exact or sum(x.count for x in cuts) <= EXACT
    return f"{'' if exact else 'up to '}{count} descriptors of {nbytes / max(count, 1):.0f} B mean"


def _made(strategy: str, why: str, dst: CacheDescription, cuts: list[Layout],
          staging: tuple[Staging, ...] = ()) -> Plan:
    # A description whose strides or extents claim more than its leaves span (a corrupt or
    # hostile handshake) must not turn into a read or a write outside them. Checked once per
    # description over every read on it (a staged plan's chunks share their two sides).
    sides: dict[int, tuple[CacheDescription, list[np.ndarray]]] = {}
    for cut in cuts:
        for descs, side in zip(cut.descs, (cut.src, cut.dst), strict=True):
            sides.setdefault(id(side), (side, []))[1].append(descs)
    for side, found in sides.values():
        wrong = outside(np.concatenate(found) if len(found) > 1 else found[0], side)
        if wrong:
            raise KVLayoutError(f"{wrong} descriptors would fall outside the tensors of {side} "
                                f"(its strides and extents do not fit its leaves of {side.span} bytes)")
    chunks = [st.chunk for st in staging] if staging else [0] * len(cuts)
    reads = tuple(sorted((Read(cut.src.tp_rank, *cut.descs, chunk) for cut, chunk in zip(cuts, chunks, strict=True)),
                         key=lambda r: r.chunk))
    return Plan(strategy, why, dst, reads, tuple(sorted(staging, key=lambda st: st.chunk)))


__all__ = ["STRATEGIES", "Plan", "Read", "Staging", "plan"]
