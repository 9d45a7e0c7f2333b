"""Compile generated Triton kernels for a GPU without one, and count their memory accesses.

`python -m kvgen.tools.kernel_asm [--arch 90] [--only TEXT ...]` runs each selected connector's
store and load on a small CPU cache with the kernel launch intercepted, so the kernel gets
exactly the arguments (and Triton exactly the specializations) a GPU run would give it, then
compiles it for an NVIDIA target with the ptxas bundled in Triton's wheel and counts the
global loads and stores by width in the PTX. A kernel whose cache and object accesses are
16-byte vectors (`v2.b64`, `v4.b32`) moves rows at full width; scalar accesses would cost
bandwidth. Format-2 connectors have one kernel per plane, each listed with its plane; a
plane whose rows are no whole number of 16-byte vectors passes when every store moves the
plane's whole word. Needs triton without TRITON_INTERPRET; no GPU.

Triton's compile entry points used here are internal (checked with triton 3.6 to 3.8).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter
from typing import Any

from kvgen.plan.package import plan_connectors
from kvgen.plan.planes import PlanesPlan
from kvgen.spec.library import load_library

#: Small geometry with the shape of a real model's rows (8 heads of 128 bf16 values).
EXT = {"L": 2, "KV": 2, "H": 8, "C": 128, "N": 16, "B": 12}
TOKENS = 64


def captured_launches(module: str) -> list[tuple[str, Any, dict[str, Any]]]:
    """(direction, kernel, arguments) of one store and one load through `module`'s kernel."""
    # torch, and the generated package and runtime that load it: compiling PTX for a target needs none of them
    import torch

    from kvgen import generated
    from kvgen.oracle.reference.layouts import leaf_shape, nest
    from kvgen.oracle.reference.planes import make_parts_cache, parts_extents
    from kvgen.runtime import MemoryObj, kernels

    plan = {p.module: p for p in plan_connectors(load_library())}[module]
    ext = {**EXT, "C": 576} if "mla" in module else EXT
    if isinstance(plan, PlanesPlan):  # several planes: each part's tensors in their own dtype
        same = {f"C.{part.name}": ext["C"] for part in plan.paged.parts}  # every free-width part as wide as C
        cache = make_parts_cache(plan.paged, {**parts_extents(plan.paged, ext), **same}, torch.bfloat16, "cpu")
    else:
        shape = leaf_shape(plan.paged, ext)
        cache = nest(plan.paged, ext, lambda path: torch.zeros(shape, dtype=torch.bfloat16))
    connector = generated.get(plan.paged.name, plan.obj.name)(device="cpu", backend="torch")
    connector.bind(cache)
    dtype = connector.get_dtype() if getattr(connector.memory, "pack", None) is not None else torch.bfloat16
    connector._pin(torch.device("cpu"), "triton", (connector, kernels.kernel_of(type(connector).__module__)))
    mapping = torch.arange(TOKENS) + 2 * ext["N"]  # whole blocks after a partial one: both program kinds
    mapping[3] = -1
    seen: list[tuple[str, Any, dict[str, Any]]] = []
    direction = ["store"]

    def capture(fn: Any, grid: Any, args: dict[str, Any], device: Any) -> None:
        seen.append((direction[0], fn, dict(args)))

    real, kernels._launch = kernels._launch, capture
    try:
        objs = [MemoryObj(torch.zeros(connector.get_shape(TOKENS), dtype=dtype), connector.format)
                for _ in range(ext["L"] if connector.layerwise else 1)]
        if connector.layerwise:
            for _ in connector.batched_from_gpu([[o] for o in objs], [0], [TOKENS], kvcaches=cache,
                                                slot_mapping=mapping):
                break  # one layer is enough
        else:
            connector.from_gpu(objs[0], 0, TOKENS, kvcaches=cache, slot_mapping=mapping)
        direction[0] = "load"
        if connector.layerwise:
            gen = connector.batched_to_gpu([0], [TOKENS], kvcaches=cache, slot_mapping=mapping)
            next(gen)
            gen.send([objs[0]])
        else:
            connector.to_gpu(objs[0], 0, TOKENS, kvcaches=cache, slot_mapping=mapping)
    finally:
        kernels._launch = real
    return seen


def compile_ptx(fn: Any, args: dict[str, Any], arch: int) -> str:
    """PTX of `fn` specialized for `args` as JITFunction.run would, for sm_<arch>."""
    # triton: optional (only this command needs it)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(**args)
    options, signature, constexprs, attrs = fn._pack_args(backend, {}, bound, specialization, options)
    return str(triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                              options=options.__dict__).asm["ptx"])


def accesses(ptx: str) -> dict[str, dict[str, int]]:
    """Global loads and stores by instruction (`ld.global.v2.b64`: 16 bytes per thread)."""
    return {kind: dict(Counter(re.findall(rf"{kind}\.global(?:\.[a-z0-9]+)*", ptx)))
            for kind in ("ld", "st")}


def vector_rows(counts: dict[str, dict[str, int]]) -> bool:
    """Every store, and some loads, are 16-byte vectors (the loads also read slots and ids)."""
    wide = re.compile(r"\.v(2\.b64|4\.b32)$")
    return (bool(counts["st"]) and all(wide.search(op) for op in counts["st"])
            and any(wide.search(op) for op in counts["ld"]))


def access_bytes(op: str) -> int:
    """Bytes one thread moves with a PTX access (`st.global.v2.b64`: 16)."""
    m = re.search(r"(?:\.v(\d))?\.[bu](\d+)$", op)
    return int(m.group(1) or 1) * int(m.group(2)) // 8 if m else 0


def verdict(counts: dict[str, dict[str, int]], word: int) -> str | None:
    """"16-byte rows"; for a plane of a format-2 cache whose rows allow no 16-byte vectors
    (a 656-byte row is no whole number of them), "N-byte words" when every store moves the
    kernel's whole word; None when stores are narrower than that."""
    if vector_rows(counts):
        return "16-byte rows"
    if counts["st"] and all(access_bytes(op) >= word for op in counts["st"]):
        return f"{word}-byte words"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvgen.tools.kernel_asm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="NVIDIA compute capability x10 (default: 90, H100/H200)")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT",
                    help="connectors whose module name contains this text; repeatable (any of them)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("kernel_asm compiles kernels: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("kernel_asm needs triton, which is not installed: pip install 'kvgen[triton]'", file=sys.stderr)
        return 2
    wanted = args.only or [""]
    plans = {p.module: p for p in plan_connectors(load_library()) if any(text in p.module for text in wanted)}
    failed = 0
    for module, plan in plans.items():
        for direction, fn, kwargs in captured_launches(module):
            counts = accesses(compile_ptx(fn, kwargs, args.arch))
            shown = verdict(counts, kwargs["cache"].element_size())
            failed += shown is None
            index = fn.__name__.removeprefix("_copy").removeprefix("_")  # _copy_<plane index>, or _copy
            name = plan.planes[int(index)].plane.name if index else "-"
            print(f"{module:<36} {name:<8} {direction:<5} {shown or 'NARROW'}  loads {counts['ld']}  "
                  f"stores {counts['st']}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
