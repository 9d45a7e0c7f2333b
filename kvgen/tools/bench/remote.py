"""Remote rows of `kvgen bench --remote SRC:DST,...`: a kvgen.remote plan run by NIXL between
two agents in this process (UCX, DRAM), beside NIXL's own copy of the same bytes in 4 MiB
descriptors and a local memcpy of them; `--costs` measures the cost model's constants.

Each row is one (source layout, destination layout, TP sizes, block sizes): every destination
rank plans its read (the planning time is shown), reads and permutes (best of the repeats,
summed over the ranks), and is checked element by element against kvgen's generated transfer
of the same tokens from the same source caches.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvgen import generated, remote, tp
from kvgen.integrations import nixl
from kvgen.tools.pd import run as pd_run
from kvgen.tools.pd.request import Request, WorkerSide

HEADERS = ("source", "destination", "tp", "N", "strategy", "descriptors", "mean B", "plan CPU ms", "GB/s",
           "x NIXL 4 MiB", "x memcpy", "right")
#: TP sizes and block sizes of the rows, SRC_TP:DST_TP:SRC_N:DST_N.
DEFAULT_SHAPES = ("1:1:16:16", "2:4:16:32", "4:2:16:16")


@dataclass(frozen=True)
class RemoteRow:
    req: Request
    strategy: str
    count: int
    bytes: int
    plan_ms: float
    seconds: float
    plain: float
    memcpy: float
    wrong: int
    elements: int

    def cells(self) -> tuple[str, ...]:
        gbps = self.bytes / self.seconds / 1e9
        src, dst = (f"{s.layout} g={s.g}" if pd_run.grouped(s.layout) else s.layout
                    for s in (self.req.src, self.req.dst))
        return (src, dst, f"{self.req.src.tp}->{self.req.dst.tp}",
                f"{self.req.src.N}->{self.req.dst.N}", self.strategy, str(self.count),
                f"{self.bytes / max(self.count, 1):.0f}", f"{self.plan_ms:.2f}", f"{gbps:.2f}",
                f"{self.plain / self.seconds:.2f}", f"{self.memcpy / self.seconds:.2f}",
                f"{self.elements - self.wrong}/{self.elements}")


#: One row's shape: source and destination TP sizes and block sizes, and the heads per group of
#: a side that holds its heads in groups (None: the default, `group_size`).
Shape = tuple[int, int, int, int, int | None]


def shapes(text: str) -> list[Shape]:
    out: list[Shape] = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        parts = item.split(":")
        if len(parts) not in (4, 5) or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"--remote-shapes takes SRC_TP:DST_TP:SRC_N:DST_N[:G],..., got {item!r}")
        s_tp, d_tp, s_n, d_n, *g = (int(p) for p in parts)
        out.append((s_tp, d_tp, s_n, d_n, g[0] if g else None))
    return out


def group_size(heads: int, tps: tuple[int, int]) -> int:
    """Heads per group of a side that holds its heads in groups, where a row does not say: 2, as
    SGLang's page_unified pool with head groups of two heads, where every rank of both sides has
    whole groups of two (so no route cuts a group); else 1."""
    return 2 if all(tp.local_heads(heads, n) % 2 == 0 for n in tps) else 1


def request(pair: str, shape: Shape, args: argparse.Namespace) -> Request:
    """The request of one row: the `SRC:DST` pair at `shape`, each side in head groups where its
    layout holds its heads in groups."""
    src, _, dst = pair.partition(":")
    s_tp, d_tp, s_n, d_n, g = shape
    g = group_size(args.heads, (s_tp, d_tp)) if g is None else g
    sides = [WorkerSide(layout, n_tp, n, g if pd_run.grouped(generated.resolve(layout)) else 1)
             for layout, n_tp, n in ((src, s_tp, s_n), (dst, d_tp, d_n))]
    return Request(*sides, max(args.tokens), args.layers, args.heads, args.head_size, args.dtype,
                   repeats=args.repeats)


def _memcpy(nbytes: int, repeats: int) -> float:
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    best = math.inf
    for _ in range(repeats + 1):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


def _rank(req: Request, rank: int, agent: Any, prefill: list[nixl.Worker]) -> dict[str, Any]:
    tree = pd_run.caches(req, req.dst, rank, False)
    d = remote.describe(tree, req.dst.layout, tp_rank=rank, tp_size=req.dst.tp, num_kv_heads=req.heads)
    w = nixl.Worker("decode", tree, d, agent=agent, streams=nixl.STREAMS)  # new_agent's: safe across threads
    for p in prefill:
        w.connect(p.handshake())
    s, t = pd_run.slots(req, req.src, 1), pd_run.slots(req, req.dst, 2)
    plan, planned = pd_run.planned_best(w, s, t, req)
    w.run(plan)
    best = math.inf
    for _ in range(req.repeats):
        start = time.perf_counter()
        w.run(plan)
        best = min(best, time.perf_counter() - start)
    nbytes = len(s) * d.extent("L") * d.extent("KV") * d.extent("H") * d.extent("C") * d.itemsize
    plain = pd_run.plain_read(w, w.peers[min(w.peers)], nbytes, req.repeats)
    wrong = pd_run.wrong_elements(tree, pd_run.expected(req, rank, [p.caches for p in prefill]))
    w.close()
    return {"strategy": plan.strategy, "count": plan.count, "bytes": nbytes, "plan": planned, "seconds": best,
            "plain": plain, "wrong": wrong, "elements": nbytes // d.itemsize}


def row(req: Request, agents: tuple[Any, Any]) -> RemoteRow:
    prefill = []
    for rank in range(req.src.tp):
        tree = pd_run.caches(req, req.src, rank, True)
        d = remote.describe(tree, req.src.layout, tp_rank=rank, tp_size=req.src.tp, num_kv_heads=req.heads)
        prefill.append(nixl.Worker("prefill", tree, d, agent=agents[0]))
    ranks = [_rank(req, r, agents[1], prefill) for r in range(req.dst.tp)]
    for p in prefill:
        p.close()
    total = sum(r["bytes"] for r in ranks)
    strategies = sorted({r["strategy"] for r in ranks})
    return RemoteRow(req, "+".join(strategies), sum(r["count"] for r in ranks), total,
                     max(r["plan"] for r in ranks) * 1e3, sum(r["seconds"] for r in ranks),
                     sum(r["plain"] for r in ranks), _memcpy(total, req.repeats), sum(r["wrong"] for r in ranks),
                     sum(r["elements"] for r in ranks))


#: What `--costs` moves: NIXL reads of COST_READ_BYTES, and a local transfer of COST_TOKENS tokens
#: (32 layers of 8 heads of 128 bfloat16 values: 256 MiB a side).
COST_READ_BYTES = 64 << 20
COST_TOKENS = 2048


def costs(agents: tuple[Any, Any], repeats: int) -> remote.Costs:
    """The cost model's constants on this machine: NIXL reads of COST_READ_BYTES in 4 MiB and in
    4 KiB descriptors (wire bandwidth, then the per-descriptor cost), and kvgen's local transfer
    of a COST_TOKENS-token request and of one token (local bandwidth, per-permute cost)."""
    nbytes = COST_READ_BYTES
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    regs = [agents[0].register_memory(src), agents[1].register_memory(dst)]
    agents[1].add_remote_agent(agents[0].get_agent_metadata())
    seconds = {}
    for size in (4 << 20, 4 << 10):
        pairs = [((src.data_ptr() + o, size, 0), (dst.data_ptr() + o, size, 0)) for o in range(0, nbytes, size)]
        far, local = (agents[1].get_xfer_descs([p[k] for p in pairs], "DRAM") for k in (0, 1))
        best = math.inf
        for _ in range(repeats + 1):
            start = time.perf_counter()
            handle = agents[1].initialize_xfer("READ", local, far, agents[0].name)
            state = agents[1].transfer(handle)
            while state == "PROC":
                state = agents[1].check_xfer_state(handle)
            agents[1].release_xfer_handle(handle)
            best = min(best, time.perf_counter() - start)
        seconds[size] = best
    agents[0].deregister_memory(regs[0])
    agents[1].deregister_memory(regs[1])
    wire = nbytes / seconds[4 << 20]
    per_descriptor = max(seconds[4 << 10] - nbytes / wire, 0.0) / (nbytes // (4 << 10))
    local, per_permute = _local(repeats)
    return remote.Costs(per_descriptor=per_descriptor, wire=wire, local=local, per_permute=per_permute)


def _local(repeats: int) -> tuple[float, float]:
    req = Request(WorkerSide("vllm_flash_attn_nhd", 1, 16), WorkerSide("vllm_flash_attn_hnd", 1, 16), COST_TOKENS)
    a, b = pd_run.caches(req, req.src, 0, True), pd_run.caches(req, req.dst, 0, False)
    move = generated.transfer(req.src.layout, req.dst.layout)()
    s, t = pd_run.slots(req, req.src, 1), pd_run.slots(req, req.dst, 2)
    timed = {}
    for n in (len(s), 1):
        best = math.inf
        for _ in range(repeats + 1):
            start = time.perf_counter()
            move.copy(a, s[:n], b, t[:n])
            best = min(best, time.perf_counter() - start)
        timed[n] = best
    nbytes = len(s) * req.layers * 2 * req.heads * req.head_size * 2  # K and V, 2-byte values
    return nbytes / max(timed[len(s)] - timed[1], 1e-9), timed[1]


def main(args: argparse.Namespace) -> int:
    why = nixl.unavailable()
    if why:
        print(f"kvgen bench: {why}")
        return 2
    agents = (nixl.new_agent("prefill"), nixl.new_agent("decode", serves=False))
    if args.costs:
        print("KVGEN_REMOTE_COSTS=" + json.dumps(vars(costs(agents, args.repeats))))
    rows = []
    for pair in args.remote or []:
        for shape in args.remote_shapes:
            rows.append(row(pd_run.check(request(pair, shape, args)), agents))
    if rows:
        table = [HEADERS, *(r.cells() for r in rows)]
        widths = [max(len(line[k]) for line in table) for k in range(len(HEADERS))]
        for line in table:
            print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))
    return 0 if all(r.wrong == 0 for r in rows) else 1


__all__ = ["DEFAULT_SHAPES", "HEADERS", "RemoteRow", "Shape", "costs", "group_size", "main", "request", "row", "shapes"]
