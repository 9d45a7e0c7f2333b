"""`kvgen pd`: move one request's KV from prefill ranks to decode ranks through NIXL, between
two processes on this machine (loopback), and check every element.

    kvgen pd --src vllm_flash_attn_nhd:tp=2:N=16 --dst vllm_flash_attn_hnd:tp=4:N=32 --tokens 2048

The prefill process holds one NIXL agent per source rank, over caches of random bits; the
decode process one per destination rank. The decode ranks connect to every prefill rank
(the handshake goes over a pipe), plan, read, permute, then compare each rank's cache with
what kvgen's generated transfer leaves when it copies the same tokens from the same source
caches (regenerated from the seed); the suite checks that transfer against the independent
reference. Printed: `N/N elements right`, the strategy and why, the planning time, and the
throughput next to NIXL's own copy of the same bytes in 4 MiB descriptors.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import time
from dataclasses import dataclass, replace
from typing import Any

from kvgen.errors import KVGenError

#: Descriptor size of the plain NIXL copy the transfer is measured against.
PLAIN = 4 << 20


@dataclass(frozen=True)
class Side:
    layout: str
    tp: int
    N: int


@dataclass(frozen=True)
class Request:
    src: Side
    dst: Side
    tokens: int
    layers: int = 32
    heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"
    seed: int = 0
    strategy: str | None = None
    repeats: int = 3
    #: Send each decode rank's cache back with its result (small requests: tests check them).
    keep: bool = False


def side(text: str) -> Side:
    """`LAYOUT:tp=2:N=16` (tp and N optional: 1 and 16)."""
    layout, *rest = text.split(":")
    values = {"tp": 1, "N": 16}
    for item in rest:
        key, _, value = item.partition("=")
        if key not in values or not value.isdigit() or int(value) <= 0:
            raise argparse.ArgumentTypeError(f"expected LAYOUT:tp=T:N=B with positive integers, got {text!r}")
        values[key] = int(value)
    if not layout:
        raise argparse.ArgumentTypeError(f"expected LAYOUT:tp=T:N=B, got {text!r}")
    return Side(layout, values["tp"], values["N"])


def _extents(req: Request, s: Side) -> dict[str, int]:
    from kvgen import tp

    blocks = math.ceil(req.tokens / s.N) * 5 // 4 + 1  # room, so a block table is scattered
    return {"L": req.layers, "KV": 2, "H": tp.local_heads(req.heads, s.tp), "C": req.head_size, "N": s.N,
            "B": blocks, "S": blocks * s.N}


def caches(req: Request, s: Side, rank: int, fill: bool) -> Any:
    """A rank's cache: random bits from (seed, rank) for a source, zeros for a destination."""
    import torch

    from kvgen import remote
    from kvgen.runtime.binding import leaves

    tree = remote.empty(s.layout, _extents(req, s), getattr(torch, req.dtype))
    g = torch.Generator().manual_seed(req.seed * 1000 + rank)
    for t in leaves(tree):
        raw = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8)
        if fill:
            raw.copy_(torch.randint(-(1 << 15), 1 << 15, raw.shape, generator=g, dtype=torch.int32).to(raw.dtype))
        else:
            raw.zero_()
    return tree


def slots(req: Request, s: Side, salt: int) -> Any:
    """The request's tokens on one side: a block table of random blocks."""
    import torch

    g = torch.Generator().manual_seed(req.seed * 7 + salt)
    ext = _extents(req, s)
    table = torch.randperm(ext["B"], generator=g)[: math.ceil(req.tokens / s.N)]
    return (table[:, None] * s.N + torch.arange(s.N)).flatten()[: req.tokens]


def _prefill(conn: Any, req: Request) -> None:
    from kvgen import remote
    from kvgen.integrations import nixl

    workers = []
    try:
        for rank in range(req.src.tp):
            tree = caches(req, req.src, rank, True)
            d = remote.describe(tree, req.src.layout, tp_rank=rank, tp_size=req.src.tp, num_kv_heads=req.heads)
            workers.append(nixl.Worker(f"prefill-{rank}", tree, d))
    except KVGenError as why:
        conn.send(str(why))
        return
    conn.send([w.handshake() for w in workers])
    conn.recv()  # the decode side is done reading
    for w in workers:
        w.close()


def expected(req: Request, rank: int, sources: list[Any]) -> Any:
    from kvgen import generated, remote, tp

    want = caches(req, req.dst, rank, False)
    mla = not remote.layout_of(req.src.layout)[0].has("H")
    move = generated.transfer(req.src.layout, req.dst.layout)()
    for r in tp.plan(req.heads, req.src.tp, req.dst.tp, mla=mla):
        if r.dst_rank == rank:
            move.copy(sources[r.src_rank], slots(req, req.src, 1), want, slots(req, req.dst, 2),
                      src_heads=r.src_heads, dst_heads=r.dst_heads)
    return want


def wrong_elements(got: Any, want: Any) -> int:
    """Elements of `got` whose bits differ from `want`'s."""
    import torch

    from kvgen.runtime.binding import leaves
    from kvgen.runtime.ops import bits

    return sum(int(torch.count_nonzero(bits(a) != bits(b))) for a, b in zip(leaves(got), leaves(want), strict=True))


def plain_read(worker: Any, peer: Any, nbytes: int, repeats: int) -> float:
    """Best seconds NIXL takes to read `nbytes` of the peer's cache in PLAIN-byte descriptors
    into a local buffer (request made and posted each time, as a pull does)."""
    import torch

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
    """The plan, and the best seconds of planning it again (the first call also imports and
    fills caches of the layouts' facts)."""
    p, best = worker.plan(src_slots, dst_slots, strategy=req.strategy), math.inf
    for _ in range(req.repeats):
        start = time.perf_counter()
        p = worker.plan(src_slots, dst_slots, strategy=req.strategy)
        best = min(best, time.perf_counter() - start)
    return p, best


def _decode_rank(req: Request, rank: int, handshakes: list[bytes], sources: list[Any]) -> dict[str, Any]:
    from kvgen import remote
    from kvgen.integrations import nixl

    tree = caches(req, req.dst, rank, False)
    d = remote.describe(tree, req.dst.layout, tp_rank=rank, tp_size=req.dst.tp, num_kv_heads=req.heads)
    w = nixl.Worker(f"decode-{rank}", tree, d)
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
    import io

    import torch

    out = io.BytesIO()
    torch.save(tree, out)
    return out.getvalue()


def loaded(data: bytes) -> Any:
    """A cache `keep=True` sent back."""
    import io

    import torch

    return torch.load(io.BytesIO(data))


def _decode(conn: Any, req: Request) -> None:
    handshakes = conn.recv()
    if not handshakes:  # the prefill side failed
        return
    sources = [caches(req, req.src, r, True) for r in range(req.src.tp)]
    try:
        conn.send([_decode_rank(req, r, handshakes, sources) for r in range(req.dst.tp)])
    except KVGenError as why:
        conn.send(str(why))


def _relay(prefill: Any, decode: Any) -> Any:
    handshakes = prefill.recv()
    if isinstance(handshakes, str):
        decode.send([])
        return handshakes
    decode.send(handshakes)
    return decode.recv()


def run(req: Request) -> list[dict[str, Any]]:
    """Start the two processes, move the request, return one result per decode rank."""
    ctx = multiprocessing.get_context("spawn")
    pre, pre_child = ctx.Pipe()
    dec, dec_child = ctx.Pipe()
    procs = [ctx.Process(target=_prefill, args=(pre_child, req)), ctx.Process(target=_decode, args=(dec_child, req))]
    for p in procs:
        p.start()
    try:
        result = _relay(pre, dec)
    finally:
        pre.send("done")  # (again, after a failure: the prefill process waits for it)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    if isinstance(result, str):
        raise KVGenError(result)
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", type=side, required=True, metavar="LAYOUT:tp=T:N=B", help="the prefill side")
    p.add_argument("--dst", type=side, required=True, metavar="LAYOUT:tp=T:N=B", help="the decode side")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the request (default: 2048)")
    p.add_argument("-L", "--layers", type=int, default=32, help="layers (default: 32)")
    p.add_argument("--heads", type=int, default=8, help="the model's KV heads (default: 8)")
    p.add_argument("--head-size", type=int, default=128, help="C (default: 128)")
    p.add_argument("--dtype", default="bfloat16", help="element type (default: bfloat16)")
    p.add_argument("--strategy", choices=("direct", "staged"), default=None,
                   help="force a strategy (default: the cost model's choice)")
    p.add_argument("--repeats", type=int, default=3, help="timed reads per rank, the best kept (default: 3)")


def check(req: Request) -> Request:
    """The request with its layouts' spec names, or KVGenError (before any process starts)."""
    from kvgen import generated, tp
    from kvgen.integrations import nixl

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
    tp.plan(req.heads, src.tp, dst.tp)
    return replace(req, src=src, dst=dst)


def main(args: argparse.Namespace) -> int:
    req = check(Request(args.src, args.dst, args.tokens, args.layers, args.heads, args.head_size, args.dtype,
                        strategy=args.strategy, repeats=args.repeats))
    rows = run(req)
    total = sum(r["elements"] for r in rows)
    wrong = sum(r["wrong"] for r in rows)
    seconds, plain = sum(r["seconds"] for r in rows), sum(r["plain"] for r in rows)
    nbytes = sum(r["bytes"] for r in rows)
    print(f"{req.src.layout} tp={req.src.tp} N={req.src.N} -> {req.dst.layout} tp={req.dst.tp} N={req.dst.N}, "
          f"{req.tokens} tokens, L={req.layers} H={req.heads} C={req.head_size} {req.dtype}")
    for r in rows:
        print(f"  decode rank {r['rank']}: {r['strategy']} ({r['why']}); {r['count']} descriptors; "
              f"plan {r['plan_ms']:.2f} ms; {r['bytes'] / r['seconds'] / 1e9:.2f} GB/s vs NIXL 4 MiB "
              f"{r['bytes'] / r['plain'] / 1e9:.2f} GB/s")
    print(f"{total - wrong}/{total} elements right")
    print(f"throughput {nbytes / seconds / 1e9:.2f} GB/s, NIXL's 4 MiB-descriptor copy of the same bytes "
          f"{nbytes / plain / 1e9:.2f} GB/s: {plain / seconds:.2f}x")
    return 0 if wrong == 0 else 1


__all__ = ["PLAIN", "Request", "Side", "add_arguments", "caches", "check", "expected", "loaded", "main", "plain_read",
           "planned_best", "run", "side", "slots", "wrong_elements"]
