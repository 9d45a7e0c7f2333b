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

from kvgen.tools.pd.request import Request, WorkerSide


def side(text: str) -> WorkerSide:
    """`LAYOUT:tp=2:N=16` (tp and N optional: 1 and 16), and for a cache in head groups `:g=2`
    (heads per group, optional: 1)."""
    layout, *rest = text.split(":")
    values = {"tp": 1, "N": 16, "g": 1}
    for item in rest:
        key, _, value = item.partition("=")
        if key not in values or not value.isdigit() or int(value) <= 0:
            raise argparse.ArgumentTypeError(f"expected LAYOUT:tp=T:N=B[:g=G] with positive integers, got {text!r}")
        values[key] = int(value)
    if not layout:
        raise argparse.ArgumentTypeError(f"expected LAYOUT:tp=T:N=B[:g=G], got {text!r}")
    return WorkerSide(layout, values["tp"], values["N"], values["g"])


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


def main(args: argparse.Namespace) -> int:
    from kvgen.tools.pd import run as pd_run  # torch and NIXL: only when the command runs, not for `kvgen build`

    req = pd_run.check(Request(args.src, args.dst, args.tokens, args.layers, args.heads, args.head_size, args.dtype,
                        strategy=args.strategy, repeats=args.repeats))
    rows = pd_run.run(req)
    total = sum(r["elements"] for r in rows)
    wrong = sum(r["wrong"] for r in rows)
    seconds, plain = sum(r["seconds"] for r in rows), sum(r["plain"] for r in rows)
    nbytes = sum(r["bytes"] for r in rows)
    groups = [f" g={s.g}" if s.g > 1 else "" for s in (req.src, req.dst)]
    print(f"{req.src.layout} tp={req.src.tp} N={req.src.N}{groups[0]} -> {req.dst.layout} tp={req.dst.tp} "
          f"N={req.dst.N}{groups[1]}, "
          f"{req.tokens} tokens, L={req.layers} H={req.heads} C={req.head_size} {req.dtype}")
    for r in rows:
        print(f"  decode rank {r['rank']}: {r['strategy']} ({r['why']}); {r['count']} descriptors; "
              f"plan {r['plan_ms']:.2f} ms of CPU; {r['bytes'] / r['seconds'] / 1e9:.2f} GB/s vs NIXL 4 MiB "
              f"{r['bytes'] / r['plain'] / 1e9:.2f} GB/s")
    print(f"{total - wrong}/{total} elements right")
    print(f"throughput {nbytes / seconds / 1e9:.2f} GB/s, NIXL's 4 MiB-descriptor copy of the same bytes "
          f"{nbytes / plain / 1e9:.2f} GB/s: {plain / seconds:.2f}x")
    return 0 if wrong == 0 else 1


__all__ = ["Request", "WorkerSide", "add_arguments", "main", "side"]
