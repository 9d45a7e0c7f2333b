"""How long kvgen.remote.plan takes for one destination rank, alone (no NIXL agent): the pairs of
docs/remote.md's table at TP 1->1, 2->4 and 4->2 and block sizes 16->16 and 16->32. Thread CPU
time (time.thread_time: stable on a shared host, it counts only this thread) and wall time,
min-median-max over REPEATS plans after one warm-up plan (which imports the layouts and fills
the caches of their facts), milliseconds; the slowest destination rank of each row.

    python benchmarks/plan_time.py [TOKENS] [REPEATS] [--profile ROW [--sort tottime] | --agents ROW]

Caches and slot tables as `kvgen pd` makes them (kvgen.tools.pd.run: L=32, H=8, C=128, bf16,
block tables of random blocks). `--profile nhd:hnd:2:4:16:32` prints cProfile's top functions
(by cumulative thread CPU time, or --sort's key) of REPEATS plans of that row instead.
`--agents nhd:nhd:2:4:16:32` plans that row's destination rank 0 as `kvgen bench --remote` does,
in a process holding a prefill and a decode NIXL agent (needs nixl), and prints thread CPU,
the process's CPU and wall time of each plan, and the CPU the process's other threads take
in 0.5 s of idling.
"""

from __future__ import annotations

import cProfile
import glob
import pstats
import statistics
import sys
import threading
import time
from typing import Any

import torch

from kvgen import remote
from kvgen.tools.pd import run as pd_run
from kvgen.tools.pd.request import Request, WorkerSide

NAMES = {"nhd": "vllm_flash_attn_nhd", "hnd": "vllm_flash_attn_hnd", "sglang_mla": "sglang_mla",
         "vllm_mla": "vllm_mla"}
PAIRS = (("nhd", "nhd"), ("nhd", "hnd"), ("hnd", "nhd"), ("sglang_mla", "vllm_mla"))
SHAPES = ((1, 1, 16, 16), (2, 4, 16, 32), (4, 2, 16, 16), (1, 1, 16, 32))


def _request(pair: tuple[str, str], shape: tuple[int, int, int, int], tokens: int) -> Request:
    tp_s, tp_d, n_s, n_d = shape
    return Request(WorkerSide(NAMES[pair[0]], tp_s, n_s), WorkerSide(NAMES[pair[1]], tp_d, n_d), tokens)


def _cache(req: Request, side: WorkerSide) -> Any:
    """A rank's cache, never touched (the planner reads only its addresses and strides)."""
    return remote.empty(side.layout, pd_run.extents(req, side), getattr(torch, req.dtype))


def _setups(req: Request) -> list[tuple[list[Any], Any, Any, Any]]:
    """Per destination rank: the source descriptions, its own, and the two slot tables."""
    sources = []
    for rank in range(req.src.tp):
        tree = _cache(req, req.src)
        sources.append((tree, remote.describe(tree, req.src.layout, tp_rank=rank, tp_size=req.src.tp,
                                              num_kv_heads=req.heads)))
    out = []
    for rank in range(req.dst.tp):
        tree = _cache(req, req.dst)
        d = remote.describe(tree, req.dst.layout, tp_rank=rank, tp_size=req.dst.tp, num_kv_heads=req.heads)
        out.append(([s[1] for s in sources], d, pd_run.slots(req, req.src, 1), pd_run.slots(req, req.dst, 2)))
    # The caches stay alive with the descriptions (their addresses are the plan's).
    out.append(([s[0] for s in sources], None, None, None))
    return out


def _time(setup: tuple[list[Any], Any, Any, Any], repeats: int) -> tuple[list[float], list[float], str, int]:
    srcs, dst, s, t = setup
    p = remote.plan(srcs, dst, s, t)
    cpu, wall = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.thread_time()
        p = remote.plan(srcs, dst, s, t)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return cpu, wall, p.strategy, p.count


def _mmm(xs: list[float]) -> str:
    return f"{min(xs) * 1e3:.2f}-{statistics.median(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f}"


def table(tokens: int, repeats: int) -> None:
    print(f"{tokens} tokens, L=32 H=8 C=128 bfloat16; ms min-median-max of {repeats}, slowest destination rank")
    print(f"{'pair':<22}{'tp':<6}{'N':<8}{'strategy':<10}{'descs':>7}  {'thread CPU ms':<20}wall ms")
    for pair in PAIRS:
        for shape in SHAPES:
            setups = _setups(_request(pair, shape, tokens))
            rows = [_time(x, repeats) for x in setups[:-1]]
            cpu, wall, strategy, count = max(rows, key=lambda r: statistics.median(r[0]))
            print(f"{pair[0] + '->' + pair[1]:<22}{shape[0]}->{shape[1]:<3}{shape[2]}->{shape[3]:<4}{strategy:<10}"
                  f"{count:>7}  {_mmm(cpu):<20}{_mmm(wall)}")


def profile(row: str, tokens: int, repeats: int, sort: str) -> None:
    a, b, *shape = row.split(":")
    setups = _setups(_request((a, b), tuple(int(x) for x in shape), tokens))  # type: ignore[arg-type]
    srcs, dst, s, t = setups[0]
    remote.plan(srcs, dst, s, t)
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    for _ in range(repeats):
        remote.plan(srcs, dst, s, t)
    prof.disable()
    pstats.Stats(prof).sort_stats(sort).print_stats(30)


def _other_threads(seconds: float) -> dict[str, int]:
    """CPU ticks (1/100 s) each thread but this one takes while this one sleeps `seconds`."""
    def ticks() -> dict[str, int]:
        out = {}
        for path in glob.glob("/proc/self/task/*/stat"):
            fields = open(path).read().rsplit(")", 1)[1].split()
            out[path.split("/")[4]] = int(fields[11]) + int(fields[12])  # utime + stime
        return out
    before = ticks()
    time.sleep(seconds)
    after = ticks()
    me = str(threading.get_native_id())
    return {tid: n - before.get(tid, 0) for tid, n in after.items() if tid != me and n > before.get(tid, 0)}


def agents(row: str, tokens: int, repeats: int) -> None:
    from kvgen.integrations import nixl  # optional: only this mode needs it

    a, b, *shape = row.split(":")
    req = _request((a, b), tuple(int(x) for x in shape), tokens)  # type: ignore[arg-type]
    pair = (nixl.new_agent("prefill"), nixl.new_agent("decode", serves=False))
    prefill = []
    for rank in range(req.src.tp):
        tree = _cache(req, req.src)
        d = remote.describe(tree, req.src.layout, tp_rank=rank, tp_size=req.src.tp, num_kv_heads=req.heads)
        prefill.append(nixl.Worker("prefill", tree, d, agent=pair[0]))
    tree = _cache(req, req.dst)
    d = remote.describe(tree, req.dst.layout, tp_rank=0, tp_size=req.dst.tp, num_kv_heads=req.heads)
    w = nixl.Worker("decode", tree, d, agent=pair[1], streams=nixl.STREAMS)
    for p in prefill:
        w.connect(p.handshake())
    s, t = pd_run.slots(req, req.src, 1), pd_run.slots(req, req.dst, 2)
    print(f"other threads' CPU ticks (10 ms) in 0.5 s idle: {_other_threads(0.5)}")
    w.plan(s, t)
    cpu, proc, wall = [], [], []
    for _ in range(repeats):
        w0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        w.plan(s, t)
        cpu.append(time.thread_time() - c0)
        proc.append(time.process_time() - p0)
        wall.append(time.perf_counter() - w0)
    print(f"{row} rank 0, ms min-median-max of {repeats}: thread CPU {_mmm(cpu)}, process CPU {_mmm(proc)}, "
          f"wall {_mmm(wall)}")
    w.close()
    for p in prefill:
        p.close()


def main(argv: list[str]) -> None:
    row = argv[argv.index("--profile") + 1] if "--profile" in argv else None
    with_agents = argv[argv.index("--agents") + 1] if "--agents" in argv else None
    sort = argv[argv.index("--sort") + 1] if "--sort" in argv else "cumulative"
    args = [a for a in argv if not a.startswith("--") and a not in (row, sort, with_agents)]
    tokens = int(args[0]) if args else 2048
    repeats = int(args[1]) if len(args) > 1 else 7
    if with_agents:
        agents(with_agents, tokens, repeats)
    elif row:
        profile(row, tokens, repeats, sort)
    else:
        table(tokens, repeats)


if __name__ == "__main__":
    main(sys.argv[1:])
