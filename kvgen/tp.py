"""Tensor-parallel resharding: which ranks talk, and which heads each moves.

With `tp` ranks and `num_kv_heads` KV heads, vLLM and SGLang give each rank an equal run of
heads: `num_kv_heads // tp` of them when tp <= num_kv_heads, else one head, shared by
`tp // num_kv_heads` ranks in a row (rank r holds head r * num_kv_heads // tp). MLA caches hold
one latent that every rank keeps whole.

`plan(num_kv_heads, src_tp, dst_tp)` says, for a cache sharded over `src_tp` ranks being moved
to one sharded over `dst_tp` ranks, every (source rank, destination rank) pair that must move
something and the head ranges they move, in each rank's own local head indices: exactly the
`HeadRanges` a generated transfer takes (`T().copy(..., heads=route.heads)`). Every destination
head is written once, from one source rank; where heads are replicated on the source side,
destination ranks spread their reads over the replicas. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgen.errors import KVLayoutError

#: A head range (start, stop), stop excluded.
Heads = tuple[int, int]


@dataclass(frozen=True)
class HeadRanges:
    """The heads one transfer call moves: source head `src_heads[0] + j` into destination head
    `dst_heads[0] + j`, in each side's local indices; None: every head of that side. The two
    ranges travel together (a transfer checks them against its caches, before the first write)."""

    src_heads: Heads | None = None
    dst_heads: Heads | None = None


@dataclass(frozen=True)
class Route:
    """One (source rank, destination rank) pair and the heads it moves, in local indices."""

    src_rank: int
    dst_rank: int
    src_heads: Heads
    dst_heads: Heads

    @property
    def count(self) -> int:
        return self.src_heads[1] - self.src_heads[0]

    @property
    def heads(self) -> HeadRanges:
        """What a transfer call on this route takes as `heads=`."""
        return HeadRanges(self.src_heads, self.dst_heads)


def _positive(what: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise KVLayoutError(f"{what} must be a positive integer, got {value!r}")
    return value


def _check(num_kv_heads: int, tp: int, side: str) -> None:
    if tp <= num_kv_heads and num_kv_heads % tp:
        raise KVLayoutError(f"{side} tp {tp} does not divide num_kv_heads {num_kv_heads}: the engines shard "
                            "KV heads evenly (use a tp that divides the head count, or a multiple of it)")
    if tp > num_kv_heads and tp % num_kv_heads:
        raise KVLayoutError(f"{side} tp {tp} is larger than num_kv_heads {num_kv_heads} but not a multiple of it: "
                            "the engines replicate each head over tp // num_kv_heads ranks")


def local_heads(num_kv_heads: int, tp: int) -> int:
    """How many KV heads one rank holds."""
    _check(_positive("num_kv_heads", num_kv_heads), _positive("tp", tp), "the")
    return max(1, num_kv_heads // tp)


def rank_heads(num_kv_heads: int, tp: int, rank: int) -> Heads:
    """The global heads (start, stop) rank `rank` of `tp` holds."""
    count = local_heads(num_kv_heads, tp)
    if not 0 <= rank < tp:
        raise KVLayoutError(f"rank {rank} is not one of the {tp} ranks (0..{tp - 1})")
    start = rank * num_kv_heads // tp if tp > num_kv_heads else rank * count
    return (start, start + count)


def plan(num_kv_heads: int, src_tp: int, dst_tp: int, *, mla: bool = False) -> tuple[Route, ...]:
    """The routes of a move from `src_tp` ranks to `dst_tp` ranks, by destination rank then head.

    MLA (`mla=True`): each destination rank reads the whole latent, (0, 1) on both sides, from
    one source rank (rank d % src_tp, so the reads spread over the sources); `num_kv_heads` is
    not used. KVLayoutError for sizes the engines cannot shard."""
    _positive("src_tp", src_tp)
    _positive("dst_tp", dst_tp)
    if mla:
        return tuple(Route(d % src_tp, d, (0, 1), (0, 1)) for d in range(dst_tp))
    _positive("num_kv_heads", num_kv_heads)
    _check(num_kv_heads, src_tp, "source")
    _check(num_kv_heads, dst_tp, "destination")
    src = [rank_heads(num_kv_heads, src_tp, r) for r in range(src_tp)]
    dst = [rank_heads(num_kv_heads, dst_tp, r) for r in range(dst_tp)]
    holders = {h: [r for r, (a, b) in enumerate(src) if a <= h < b] for h in range(num_kv_heads)}
    return tuple(r for d in range(dst_tp) for r in _routes_to(d, holders, src, dst))


def _routes_to(d: int, holders: dict[int, list[int]], src: list[Heads], dst: list[Heads]) -> list[Route]:
    """Destination rank d's routes: its heads in runs read from one source rank each."""
    start, stop = dst[d]
    # Which copy of each head this rank reads: the k-th destination holding a head reads
    # the (k mod replicas)-th source holding it.
    replica = sum(1 for r in range(d) if dst[r][0] <= start < dst[r][1])
    routes: list[Route] = []
    run: list[int] = []  # [first head, last head + 1, source rank] of the range being grown
    for h in range(start, stop):
        s = holders[h][replica % len(holders[h])]
        if run and run[2] == s and run[1] == h:
            run[1] = h + 1
            continue
        if run:
            routes.append(_route(run, d, src, dst))
        run = [h, h + 1, s]
    routes.append(_route(run, d, src, dst))
    return routes


def explain(num_kv_heads: int, src_tp: int, dst_tp: int, *, mla: bool = False) -> list[str]:
    """The plan in words, one line per route (what `kvgen explain --tp` prints)."""
    routes = plan(num_kv_heads, src_tp, dst_tp, mla=mla)
    if mla:
        head = (f"TP {src_tp} -> {dst_tp}, MLA: every rank holds the whole latent; each destination rank reads it "
                "from one source rank")
    else:
        head = (f"TP {src_tp} -> {dst_tp}, {num_kv_heads} KV heads: a source rank holds "
                f"{local_heads(num_kv_heads, src_tp)}, a destination rank {local_heads(num_kv_heads, dst_tp)}"
                + (" (heads replicated over ranks: each is read from one)" if max(src_tp, dst_tp) > num_kv_heads
                   else ""))
    lines = [head]
    for r in routes:
        first = 0 if mla else rank_heads(num_kv_heads, src_tp, r.src_rank)[0] + r.src_heads[0]
        where = "" if mla else f"   global head {first}" if r.count == 1 else \
            f"   global heads {first}..{first + r.count - 1}"
        lines.append(f"  src rank {r.src_rank} -> dst rank {r.dst_rank}: src_heads={r.src_heads}, "
                     f"dst_heads={r.dst_heads}{where}")
    lines.append(f"{len(routes)} transfer calls: T().copy(src_caches, src_slots, dst_caches, dst_slots, "
                 "heads=route.heads) on each route")
    return lines


def _route(run: list[int], d: int, src: list[Heads], dst: list[Heads]) -> Route:
    first, end, s = run
    return Route(s, d, (first - src[s][0], end - src[s][0]), (first - dst[d][0], end - dst[d][0]))


__all__ = ["HeadRanges", "Heads", "Route", "explain", "local_heads", "plan", "rank_heads"]
