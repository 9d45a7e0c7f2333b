"""The work of `kvgen pd` (kvgen.tools.pd.command is its torch-free command line): the prefill and
decode processes, the ranks' caches and slot tables, the expected caches, NIXL's plain copy.
"""

from __future__ import annotations

import contextlib
import io
import math
import time
from dataclasses import replace
from typing import Any

import torch

from kvgen import generated, remote, tp
from kvgen.errors import KVGenError
from kvgen.integrations import nixl
from kvgen.remote.describe import PLACE
from kvgen.remote.plan import group_cut
from kvgen.runtime.binding import leaves
from kvgen.runtime.ops import bits
from kvgen.tools.pd.request import PLAIN, Request, WorkerSide
from kvgen.tools.processes import worker_context


def _mla(layout: str) -> bool:
    paged = remote.layout_of(layout)[0]
    return not paged.has("H") and paged.head_split is None


def grouped(layout: str) -> bool:
    """Whether `layout` holds its heads in groups (a head split of a size read from the cache)."""
    return remote.layout_of(layout)[0].head_split is not None


def extents(req: Request, s: WorkerSide) -> dict[str, int]:
    blocks = math.ceil(req.tokens / s.N) * 5 // 4 + 1  # room, so a block table is scattered
    heads = 1 if _mla(s.layout) else tp.local_heads(req.heads, s.tp)
    ext = {"L": req.layers, "KV": 2, "H": heads, "C": req.head_size, "N": s.N, "B": blocks, "S": blocks * s.N}
    return {**ext, PLACE: s.g} if grouped(s.layout) else ext


def caches(req: Request, s: WorkerSide, rank: int, fill: bool) -> Any:
    """A rank's cache: random bits from (seed, rank) for a source, zeros for a destination."""
    tree = remote.empty(s.layout, extents(req, s), getattr(torch, req.dtype))
    g = torch.Generator().manual_seed(req.seed * 1000 + rank)
    for t in leaves(tree):
        raw = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8)
        if fill:
            raw.copy_(torch.randint(-(1 << 15), 1 << 15, raw.shape, generator=g, dtype=torch.int32).to(raw.dtype))
        else:
            raw.zero_()
    return tree


def slots(req: Request, s: WorkerSide, salt: int) -> Any:
    """The request's tokens on one side: a block table of random blocks."""
    g = torch.Generator().manual_seed(req.seed * 7 + salt)
    ext = extents(req, s)
    table = torch.randperm(ext["B"], generator=g)[: math.ceil(req.tokens / s.N)]
    return (table[:, None] * s.N + torch.arange(s.N)).flatten()[: req.tokens]


def _prefill(conn: Any, req: Request) -> None:
    """Every source rank's cache, each a Worker on one shared agent: a serving agent's progress
    thread keeps a core busy while the decode side works, so one agent, not one a rank, leaves
    the decode side the other cores."""
    workers = []
    try:
        agent = nixl.new_agent("prefill")
        for rank in range(req.src.tp):
            tree = caches(req, req.src, rank, True)
            d = remote.describe(tree, req.src.layout, tp_rank=rank, tp_size=req.src.tp, num_kv_heads=req.heads)
            workers.append(nixl.Worker(f"prefill-{rank}", tree, d, agent=agent))
    except Exception as why:  # any failure comes back as one message, never as a silent exit
        conn.send(_said(why))
        return
    conn.send([w.handshake() for w in workers])
    conn.recv()  # the decode side is done reading
    for w in workers:
        w.close()


def expected(req: Request, rank: int, sources: list[Any]) -> Any:
    want = caches(req, req.dst, rank, False)
    mla = _mla(req.src.layout)
    move = generated.transfer(req.src.layout, req.dst.layout)()
    for r in tp.plan(req.heads, req.src.tp, req.dst.tp, mla=mla):
        if r.dst_rank == rank:
            move.copy(sources[r.src_rank], slots(req, req.src, 1), want, slots(req, req.dst, 2), heads=r.heads)
    return want


def wrong_elements(got: Any, want: Any) -> int:
    """Elements of `got` whose bits differ from `want`'s."""
    return sum(int(torch.count_nonzero(bits(a) != bits(b))) for a, b in zip(leaves(got), leaves(want), strict=True))


def plain_read(worker: Any, peer: Any, nbytes: int, repeats: int) -> float:
    """Best seconds NIXL takes to read `nbytes` of the peer's cache in PLAIN-byte descriptors
    into a local buffer (request made and posted each time, as a pull does)."""
    buffer = torch.zeros(nbytes, dtype=torch.uint8)  # touched: no first-touch faults while timed
    reg = worker.agent.register_memory(buffer)
    src, dst, at = [], [], 0
    while at < nbytes:
        for base in peer.description.leaves:
            for off in range(0, peer.description.span, PLAIN):
                n = min(PLAIN, peer.description.span - off, nbytes - at)
                if n <= 0:
                    break
                src.append((base + off, n, 0))
                dst.append((buffer.data_ptr() + at, n, 0))
                at += n
    far, local = (worker.agent.get_xfer_descs(x, "DRAM") for x in (src, dst))
    best = math.inf
    for _ in range(repeats + 1):  # the first connects
        start = time.perf_counter()
        handle = worker.agent.initialize_xfer("READ", local, far, peer.agent)
        worker.agent.transfer(handle)
        worker._wait([handle])
        best = min(best, time.perf_counter() - start)
    worker.agent.deregister_memory(reg)
    return best


def planned_best(worker: Any, src_slots: Any, dst_slots: Any, req: Request) -> tuple[Any, float]:
    """The plan, and the best thread CPU seconds of planning it again (the first call also imports
    and fills caches of the layouts' facts). Thread CPU, not wall: in a process with NIXL agents
    their progress threads keep up to a core busy while idle, so on a host of few cores a plan's
    wall time is mostly waiting for a core (3x its CPU time on the 2-core development machine)."""
    p, best = worker.plan(src_slots, dst_slots, strategy=req.strategy), math.inf
    for _ in range(req.repeats):
        start = time.thread_time()
        p = worker.plan(src_slots, dst_slots, strategy=req.strategy)
        best = min(best, time.thread_time() - start)
    return p, best


def _decode_rank(req: Request, rank: int, handshakes: list[bytes], sources: list[Any]) -> dict[str, Any]:
    tree = caches(req, req.dst, rank, False)
    d = remote.describe(tree, req.dst.layout, tp_rank=rank, tp_size=req.dst.tp, num_kv_heads=req.heads)
    w = nixl.Worker(f"decode-{rank}", tree, d, serves=False)  # it only pulls
    for h in handshakes:
        w.connect(h)
    s, t = slots(req, req.src, 1), slots(req, req.dst, 2)
    p, planned = planned_best(w, s, t, req)
    w.run(p)  # the first read also connects
    runs = []
    for _ in range(req.repeats):
        start = time.perf_counter()
        w.run(p)
        runs.append(time.perf_counter() - start)
    moved = int(((s >= 0) & (t >= 0)).sum()) * d.extent("L") * d.extent("KV") * d.extent("H") * d.extent("C")
    nbytes = moved * d.itemsize
    first = w.peers[min(w.peers)]
    plain = plain_read(w, first, nbytes, req.repeats)
    wrong = wrong_elements(tree, expected(req, rank, sources))
    w.close()
    kept = {"caches": _saved(tree)} if req.keep else {}
    return {**kept, "rank": rank, "elements": moved, "wrong": wrong, "bytes": nbytes, "seconds": min(runs),
            "plain": plain, "plan_ms": planned * 1e3, "strategy": p.strategy, "why": p.why, "count": p.count}


def _saved(tree: Any) -> bytes:
    """A cache as bytes: a pipe would otherwise share the tensors' memory with the receiver."""
    out = io.BytesIO()
    torch.save(tree, out)
    return out.getvalue()


def loaded(data: bytes) -> Any:
    """A cache `keep=True` sent back."""
    return torch.load(io.BytesIO(data))


def _decode(conn: Any, req: Request) -> None:
    handshakes = conn.recv()
    if not handshakes:  # the prefill side failed
        return
    sources = [caches(req, req.src, r, True) for r in range(req.src.tp)]
    try:
        conn.send([_decode_rank(req, r, handshakes, sources) for r in range(req.dst.tp)])
    except Exception as why:  # any failure comes back as one message, never as a silent exit
        conn.send(_said(why))


def _said(why: Exception) -> str:
    """A child's failure as the parent reports it: kvgen's own errors as they are, others with their type."""
    return str(why) if isinstance(why, KVGenError) else f"{type(why).__name__}: {why}"


def _relay(prefill: Any, decode: Any) -> Any:
    try:
        handshakes = prefill.recv()
    except EOFError:
        decode.send([])
        return "the prefill process ended before it sent its handshakes"
    if isinstance(handshakes, str):
        decode.send([])
        return handshakes
    decode.send(handshakes)
    try:
        return decode.recv()
    except EOFError:
        return "the decode process ended before it sent its result"


#: What the fork server imports before it forks the two processes (kvgen.tools.processes).
PRELOAD = ("torch", "kvgen.tools.pd.run")


def run(req: Request) -> list[dict[str, Any]]:
    """Start the two processes, move the request, return one result per decode rank."""
    ctx = worker_context(PRELOAD)
    pre, pre_child = ctx.Pipe()
    dec, dec_child = ctx.Pipe()
    procs = [ctx.Process(target=_prefill, args=(pre_child, req)), ctx.Process(target=_decode, args=(dec_child, req))]
    for p in procs:
        p.start()
    pre_child.close()  # each child holds its own end: a child that dies is an EOF here, not a wait forever
    dec_child.close()
    try:
        result = _relay(pre, dec)
    finally:
        with contextlib.suppress(OSError):  # a prefill process that ended already has no pipe to hear it
            pre.send("done")  # (again, after a failure: the prefill process waits for it)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    if isinstance(result, str):
        raise KVGenError(result)
    return result


def check(req: Request) -> Request:
    """The request with its layouts' spec names, or KVGenError (before any process starts)."""
    why = nixl.unavailable()
    if why:
        raise KVGenError(why)
    for what, value in (("--tokens", req.tokens), ("--layers", req.layers), ("--heads", req.heads),
                        ("--head-size", req.head_size), ("--repeats", req.repeats)):
        if value <= 0:
            raise KVGenError(f"{what} must be positive, got {value}")
    src, dst = replace(req.src, layout=generated.resolve(req.src.layout)), \
        replace(req.dst, layout=generated.resolve(req.dst.layout))
    generated.transfer(src.layout, dst.layout)  # the check's expected caches need it; names the partners
    for s in (src, dst):
        if not grouped(s.layout) and s.g != 1:
            raise KVGenError(f"{s.layout} does not hold its heads in groups: g= is for a cache that does")
        if grouped(s.layout) and tp.local_heads(req.heads, s.tp) % s.g:
            raise KVGenError(f"{s.layout}: {tp.local_heads(req.heads, s.tp)} heads a rank (--heads {req.heads}, "
                             f"tp={s.tp}) are not whole groups of g={s.g}")
    for route in tp.plan(req.heads, src.tp, dst.tp, mla=_mla(src.layout)):
        why = group_cut(route, (src.layout, dst.layout), (src.g, dst.g))
        if why:
            raise KVGenError(why)
    return replace(req, src=src, dst=dst)


__all__ = ["caches", "check", "expected", "extents", "grouped", "loaded", "plain_read", "planned_best", "run", "slots",
           "wrong_elements"]
