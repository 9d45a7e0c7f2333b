"""How fast torch can move 32 KiB block rows at all on this machine, against a plain copy.

The NHD store of a 2048-token chunk is, per layer and K/V plane, an `index_select` of 128
rows of 32 KiB. This script times that op alone (random and identity row order) and 64
plain slab copies, next to one flat `copy_` of the same 256 MiB, at 1 and 2 threads.

Usage: python benchmarks/row_copy_ceiling.py
"""

from __future__ import annotations

import time

import torch


def median_seconds(fn, runs: int = 7) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[runs // 2]


def main() -> None:
    layers, blocks, used = 32, 256, 128
    row = 16 * 8 * 128 * 2 // 16  # one block of one plane (N=16, H=8, C=128, bf16) in 16-byte words
    caches = [torch.ones(2, blocks, row, dtype=torch.complex128) for _ in range(layers)]
    obj = torch.zeros(2, layers, used, row, dtype=torch.complex128)
    nbytes = obj.numel() * obj.element_size()
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    shuffled, ordered = torch.randperm(blocks)[:used], torch.arange(used)

    def rows(index: torch.Tensor) -> None:
        for layer in range(layers):
            for kv in range(2):
                torch.index_select(caches[layer][kv], 0, index, out=obj[kv, layer])

    def slabs() -> None:
        for layer in range(layers):
            for kv in range(2):
                obj[kv, layer].copy_(caches[layer][kv][:used])

    for threads in (1, 2):
        torch.set_num_threads(threads)
        gbps = {name: nbytes / median_seconds(fn) / 1e9 for name, fn in (
            ("memcpy", lambda: dst.copy_(src)), ("slab copies", slabs),
            ("rows in order", lambda: rows(ordered)), ("rows shuffled", lambda: rows(shuffled)))}
        print(f"threads={threads}: " + " | ".join(f"{k} {v:.1f} GB/s" for k, v in gbps.items()))


if __name__ == "__main__":
    main()
