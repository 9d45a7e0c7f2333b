"""What a connector call costs around its copy: each connector's store and load with the
compiled kernel's copies replaced by C functions that return at once, so what is left is the
Python of a call (the binding check of every leaf, the slot plan, the object checks, per
layer the re-checks and the step) and the ctypes calls. Thread CPU time, the 10th percentile
of 200 calls, microseconds; stable on a busy host, since it counts only this thread's time.

    python benchmarks/call_overhead.py [TOKENS] [LAYOUT:OBJECT,...]

Caches as `kvgen bench` makes them: bf16, L=32, H=8, C=128 (MLA: C=576), N=16, blocks in
order. Needs a C compiler (the no-op is compiled into a private temporary folder).
"""

from __future__ import annotations

import ctypes
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvgen.runtime import native
from kvgen.runtime.host import compiler
from kvgen.spec.library import load_library
from kvgen.tools.bench.run import Transfers, make_cache
from kvgen.tools.bench.targets import connector_package, extents, slot_mapping

DEFAULT = ("vllm_flash_attn_nhd:kv_2ltd,vllm_flash_attn_nhd:kv_t2d,vllm_mla:kv_mla,vllm_mla:kv_mla_layer,"
           "vllm_int8_per_token_head:kv_planes")
NOOP = ("int kvgen_move(int a, int b, const void *c, long d, void *e, long f, void *g, int h, int i)\n"
        "{ return 0; }\n"
        "int kvgen_move_planes(int a, int b, int c, const void *d, const void *e, void *f, int g, int h)\n"
        "{ return 0; }\n")


class _NoCopy:
    """The loaded kernel library with its copies (kvgen_move, kvgen_move_planes) no-ops; every
    other entry point (the slot passes, a model's state rows) as loaded."""

    def __init__(self, real: object, noop: tuple[object, object]):
        self._real = real
        self.kvgen_move, self.kvgen_move_planes = noop

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


def _noop(folder: Path) -> tuple[object, object]:
    cc = compiler()
    if cc is None:
        raise SystemExit("call_overhead: needs a C compiler (cc, gcc or clang)")
    src, lib = folder / "noop.c", folder / "noop.so"
    src.write_text(NOOP)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    loaded, real = ctypes.CDLL(str(lib)), native.library()
    fns = loaded.kvgen_move, loaded.kvgen_move_planes
    for fn, like in zip(fns, (real.kvgen_move, real.kvgen_move_planes), strict=True):
        fn.restype, fn.argtypes = ctypes.c_int, like.argtypes
    return fns


def cpu_us(fn: Callable[[], None], calls: int = 200) -> float:
    times = []
    for _ in range(calls):
        start = time.thread_time_ns()
        fn()
        times.append(time.thread_time_ns() - start)
    return sorted(times)[len(times) // 10] / 1e3


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    pairs = [p.split(":") for p in (sys.argv[2] if len(sys.argv) > 2 else DEFAULT).split(",")]
    library, blocks = load_library([]), -(-tokens * 5 // (4 * 16))
    real = native.library()
    if real is None:
        raise SystemExit(f"call_overhead: {native.unavailable()}")
    with tempfile.TemporaryDirectory() as tmp, connector_package([]) as package:
        noop = _noop(Path(tmp))
        print(f"{'layout':<26} {'object':<14} {'store us':>9} {'load us':>9}   ({tokens} tokens, L=32)")
        for layout, obj in pairs:
            paged = library[layout]
            cache = make_cache(paged, extents(paged, 32, 8, 128, 16, blocks), torch.bfloat16, "cpu",
                               torch.Generator().manual_seed(0))
            mapping = torch.tensor(slot_mapping(tokens, blocks, 16, "contiguous", random.Random(0)))
            connector = package.get(layout, obj)(device="cpu")
            connector.bind(cache)
            run = Transfers(connector, None, cache, mapping, tokens, torch.bfloat16)
            run.store()  # labels the objects, so that a load accepts them
            native._state["lib"] = _NoCopy(real, noop)
            try:
                print(f"{layout:<26} {obj:<14} {cpu_us(run.store):>9.0f} {cpu_us(run.load):>9.0f}")
            finally:
                native._state["lib"] = real


if __name__ == "__main__":
    main()
