"""The two choices of the compiled CPU path, measured: streaming stores or plain ones, and
the kernel's shares on torch's OpenMP threads or on threads of its own.

For an NHD cache (bf16, L=32, H=8, C=128, N=16, random blocks) and a KV_2LTD chunk of 256
and 2048 tokens, the script times the kernel call alone (the chunk described once, no
Python checks) in four variants, each store and load, next to a flat `copy_` of the same
bytes. Every repeat runs all contenders in a rotated order, each right after a torch op, as
in an engine; the ratio to the plain copy is taken per repeat (min-median-max).

Usage: python benchmarks/native_choices.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from kvgen.generated.vllm_flash_attn_nhd__kv_2ltd import Connector
from kvgen.runtime import host, native
from kvgen.runtime.slots import plan_chunk
from kvgen.tools.bench.targets import slot_mapping


def variants(tokens: int) -> tuple[dict[str, Callable[[], None]], int]:
    """The eight kernel variants of one chunk (one cache and object shared by all), and its bytes."""
    layers, heads, size, n = 32, 8, 128, 16
    blocks = -(-2048 * 5 // (4 * n))
    cache = [torch.randn(2, blocks, n, heads, size, dtype=torch.bfloat16) for _ in range(layers)]
    mapping = torch.tensor(slot_mapping(tokens, blocks, n, "random", random.Random(0)), dtype=torch.long)
    c = Connector(device="cpu")
    g = c.bind(cache)
    obj = torch.empty(c.get_shape(tokens), dtype=torch.bfloat16)
    ck = plan_chunk(mapping, 0, tokens, num_slots=g.S, block_size=g.N)
    binding, _ = c._bind(cache)
    m = native.layout_map(c.layout, c.memory)
    threads = torch.get_num_threads()
    team = native.team()
    entries = host.openmp_entries(team) if team else None

    def variant(store: bool, stream: bool, on_team: bool) -> Callable[[], None]:
        def call() -> None:
            native.library().kvgen_use_openmp(*(entries if on_team and entries else (None, None, None)))
            native.move(m, store, None, obj, cache, g, ck, threads, binding, stream)
        return call

    fns = {f"{'store' if st else 'load'} {'streamed' if sm else 'plain'} {'torch team' if tm else 'own threads'}":
           variant(st, sm, tm) for st in (True, False) for sm in (False, True) for tm in (True, False)}
    return fns, obj.numel() * obj.element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    if native.team() is None:
        print("torch's OpenMP runtime was not found here: only the own-threads variants are meaningful")
    print(f"CPU: {torch.get_num_threads()} torch threads; torch's OpenMP runtime: {native.team()}")
    for tokens in (256, 2048):
        fns, nbytes = variants(tokens)
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.zeros_like(src)
        fns["memcpy"] = lambda dst=dst, src=src: dst.copy_(src)
        touch = torch.ones(1 << 20)
        names = list(fns)
        seconds: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.repeats + 2):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                touch.mul_(1.0)  # a torch op first: its workers are spinning, as after an engine's step
                t0 = time.perf_counter()
                fns[name]()
                if r >= 2:
                    seconds[name].append(time.perf_counter() - t0)
        print(f"\n{tokens} tokens ({nbytes / 2**20:.0f} MiB), x memcpy per repeat, min-median-max:")
        for name in names[:-1]:
            ratios = sorted(a / b for a, b in zip(seconds["memcpy"], seconds[name], strict=True))
            print(f"  {name:32s} {ratios[0]:.2f}-{statistics.median(ratios):.2f}-{ratios[-1]:.2f}")
    native.reset()  # registers torch's runtime again


if __name__ == "__main__":
    main()
