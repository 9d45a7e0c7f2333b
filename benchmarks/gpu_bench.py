"""GPU figures for the generated Triton kernels: kernel vs torch path vs device copy.

    python benchmarks/gpu_bench.py --json benchmarks/results-gpu.json      # ~3-6 minutes on an H200

For each connector and chunk size (256 and 2048 tokens; L=32, 8 KV heads of 128 bf16
values, N=16, the chunk's blocks drawn at random from a cache with spare blocks; caches of
several planes, such as vLLM's fp8 MLA rows, in their own dtypes and widths), store
(from_gpu) and load (to_gpu), it times, as GB/s of KV moved:

  kernel        the connector with backend="triton", object on the GPU (one launch per chunk,
                per layer when layerwise; per plane for caches of several planes) -- the
                whole call: checks, slot planning, launch
  kernel_only   the kernel launch alone, the chunk planned beforehand (what the GPU does)
  torch         the connector with backend="torch", object on the GPU
  copy          dst.copy_(src) of the same bytes on the GPU (device-to-device)
  pinned_*      the object in pinned host memory, use_gpu=True (gather on the GPU into a
                staging tensor, one transfer): kernel and torch, against a plain pinned
                host <-> device copy of the same bytes (pinned_copy)

Each figure is the median of --repeats timings of --iters back-to-back calls, contenders in
rotated order; ratios to `copy` (and pinned ones to `pinned_copy`) are paired per repeat and
shown min-median-max. Before timing, the kernel's result is compared bit for bit with the
torch path's. The target: one launch per chunk, kernel_only >= 0.8x copy at 256 tokens.
Needs a CUDA (or XPU) device and triton; writes JSON with the machine's facts.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvgen import generated
from kvgen.runtime import MemoryObj, backend_for, kernels
from kvgen.runtime.movers.triton import TritonMover
from kvgen.spec.library import load_library
from kvgen.tools.bench.measure import paired_ratios, rotation
from kvgen.tools.bench.run import make_cache
from kvgen.tools.bench.targets import extents, slot_mapping

PAIRS = [("vllm_flash_attn_nhd", "kv_2ltd"), ("vllm_flash_attn_nhd", "kv_t2d"), ("vllm_flash_attn_hnd", "kv_2ltd"),
         ("vllm_flash_attn_hnd", "kv_t2d"), ("vllm_cross_layer", "kv_2ltd"), ("sglang_mha", "kv_2ltd"),
         ("vllm_mla", "kv_mla"),
         # caches of several planes: one kernel launch per plane
         ("vllm_mla_fp8", "kv_mla_rows"), ("vllm_fp8_tensor_scales", "kv_planes"),
         ("vllm_gaudi_fp8", "kv_planes_layer"), ("vllm_dsa_indexer", "kv_planes")]


class Case:
    """One connector at one chunk size: caches, objects and the contenders' calls."""

    def __init__(self, layout: str, obj: str, tokens: int, device: torch.device, args: argparse.Namespace,
                 rng: random.Random):
        library = load_library()
        paged = library[layout]
        num_blocks = -(-tokens * 5 // (4 * args.block_size))
        ext = extents(paged, args.layers, args.heads, args.head_size, args.block_size, num_blocks)
        gen = torch.Generator(device="cpu").manual_seed(args.seed)
        self.cache = make_cache(paged, ext, torch.bfloat16, device, gen)
        mapping = slot_mapping(tokens, num_blocks, args.block_size, "random", rng)
        self.mapping = torch.tensor(mapping, dtype=torch.long, device=device)
        cls = generated.get(layout, obj)
        self.kernel = cls(device=device, backend="triton")
        self.torch = cls(device=device, backend="torch")
        self.pinned_kernel = cls(device=device, backend="triton", use_gpu=True)
        self.pinned_torch = cls(device=device, backend="torch", use_gpu=True)
        for c in (self.kernel, self.torch, self.pinned_kernel, self.pinned_torch):
            c.bind(self.cache)
        self.layerwise, self.tokens, self.device = self.kernel.layerwise, tokens, device
        shape_o = self.kernel.get_shape(tokens)
        count = ext["L"] if self.layerwise else 1
        # packed objects (caches of several planes) have their own dtype: bytes for regions;
        # zeroed, since no copy writes the padding between regions
        dtype = self.kernel.get_dtype() if getattr(cls.memory, "pack", None) is not None else torch.bfloat16
        self.objs = [MemoryObj(torch.zeros(shape_o, dtype=dtype, device=device), self.kernel.format)
                     for _ in range(count)]
        self.twin = [MemoryObj(torch.zeros(shape_o, dtype=dtype, device=device), self.kernel.format)
                     for _ in range(count)]
        self.host = [MemoryObj(_pinned(torch.empty(shape_o, dtype=dtype), device), self.kernel.format)
                     for _ in range(count)]
        self.nbytes = sum(o.tensor.numel() * o.tensor.element_size() for o in self.objs)
        self.src = torch.empty(self.nbytes, dtype=torch.uint8, device=device).random_()
        self.dst = torch.empty_like(self.src)
        self.pinned = _pinned(torch.empty(self.nbytes, dtype=torch.uint8), device)
        # the kernel launch alone: the Triton mover with the call planned once beforehand
        self.mover = TritonMover()
        self.prepared = self.mover.prepare(self.kernel, device)
        self.call = self.kernel._begin(self.cache, self.mapping, [0], [tokens], 0, 0)

    def store(self, c: Any, objs: list[Any]) -> None:
        kw = {"kvcaches": self.cache, "slot_mapping": self.mapping}
        if self.layerwise:
            for _ in c.batched_from_gpu([[o] for o in objs], [0], [self.tokens], **kw):
                pass
        else:
            c.from_gpu(objs[0], 0, self.tokens, **kw)

    def load(self, c: Any, objs: list[Any]) -> None:
        kw = {"kvcaches": self.cache, "slot_mapping": self.mapping}
        if self.layerwise:
            gen = c.batched_to_gpu([0], [self.tokens], **kw)
            next(gen)
            for o in objs:
                gen.send([o])
            next(gen)
        else:
            c.to_gpu(objs[0], 0, self.tokens, **kw)

    def kernel_only(self, store: bool) -> None:
        (ck,) = self.call.chunks
        for layer, o in enumerate(self.objs):
            self.mover.move(self.prepared, store, o.tensor, self.call, ck, layer if self.layerwise else None)

    def contenders(self, direction: str) -> dict[str, Any]:
        move = self.store if direction == "store" else self.load
        to_host = direction == "store"
        return {
            "kernel": lambda: move(self.kernel, self.objs),
            "kernel_only": lambda: self.kernel_only(to_host),
            "torch": lambda: move(self.torch, self.objs),
            "copy": lambda: self.dst.copy_(self.src),
            "pinned_kernel": lambda: move(self.pinned_kernel, self.host),
            "pinned_torch": lambda: move(self.pinned_torch, self.host),
            "pinned_copy": (lambda: self.pinned.copy_(self.src, non_blocking=True)) if to_host
            else (lambda: self.dst.copy_(self.pinned, non_blocking=True)),
        }

    def agree(self) -> dict[str, bool]:
        """The kernel's store and load leave the torch path's bits."""
        self.store(self.kernel, self.objs)
        self.store(self.torch, self.twin)
        stored = all(torch.equal(_bits(a.tensor), _bits(b.tensor)) for a, b in zip(self.objs, self.twin, strict=True))
        for o in self.objs:
            _bits(o.tensor).bitwise_not_()
        before = [t.clone() for t in _leaves(self.cache)]
        self.load(self.kernel, self.objs)
        after_kernel = [t.clone() for t in _leaves(self.cache)]
        for t, b in zip(_leaves(self.cache), before, strict=True):
            t.copy_(b)
        self.load(self.torch, self.objs)
        loaded = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(after_kernel, _leaves(self.cache), strict=True))
        return {"store": stored, "load": loaded}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor of any dtype (a 0-dim scale included)."""
    return t.reshape(-1).view(torch.uint8)


def _pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Page-locked host memory (a plain host tensor in a CPU smoke run, which has none)."""
    return t if device.type == "cpu" else t.pin_memory()


def _leaves(tree: Any) -> list[torch.Tensor]:
    return [tree] if isinstance(tree, torch.Tensor) else [t for sub in tree for t in _leaves(sub)]


def timed(fns: dict[str, Any], sync: Any, iters: int, repeats: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each contender per repeat (mean over `iters` back-to-back calls)."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
        sync()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in rotation(names, r):
            sync()
            t0 = time.perf_counter()
            for _ in range(iters):
                fns[name]()
            sync()
            times[name].append((time.perf_counter() - t0) / iters)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda or xpu (default: cuda)")
    ap.add_argument("--tokens", default="256,2048", help="chunk sizes (default: 256,2048)")
    ap.add_argument("--pairs", default=None, help="layout:object list (default: " +
                    ",".join(f"{a}:{b}" for a, b in PAIRS) + ")")
    ap.add_argument("-L", "--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20, help="back-to-back calls per timing (default: 20)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    why = kernels.unavailable(device)
    if why:
        print(f"gpu_bench: the kernels cannot run on {device}: {why}", file=sys.stderr)
        return 2
    backend = backend_for(device)

    def sync() -> None:
        backend.synchronize(backend.current_stream())

    pairs = [tuple(p.split(":")) for p in args.pairs.split(",")] if args.pairs else PAIRS
    rng = random.Random(args.seed)
    rows = []
    started = time.perf_counter()
    for layout, obj in pairs:
        for tokens in [int(t) for t in args.tokens.split(",")]:
            case = Case(layout, obj, tokens, device, args, rng)
            agree = case.agree()
            for direction in ("store", "load"):
                seconds = timed(case.contenders(direction), sync, args.iters, args.repeats, args.warmup)
                gbps = {k: case.nbytes / statistics.median(v) / 1e9 for k, v in seconds.items()}
                ratios = {k: vars(paired_ratios(seconds["pinned_copy" if k.startswith("pinned") else "copy"], v))
                          for k, v in seconds.items()}
                row = {"layout": layout, "obj": obj, "mode": "layerwise" if case.layerwise else "whole",
                       "tokens": tokens, "dir": direction, "bytes": case.nbytes,
                       "kernel_matches_torch": agree[direction], "gbps": gbps, "x_copy": ratios,
                       "us": {k: statistics.median(v) * 1e6 for k, v in seconds.items()}}
                rows.append(row)
                print(f"{layout:<20} {obj:<8} T={tokens:<5} {direction:<5} "
                      + "  ".join(f"{k} {gbps[k]:.0f} GB/s ({ratios[k]['median']:.2f}x)" for k in seconds)
                      + f"  match={agree[direction]}", flush=True)
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()
    import triton

    facts = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
             "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
             "seconds": time.perf_counter() - started, "command": " ".join(sys.argv)}
    if args.json:
        args.json.write_text(json.dumps({"machine": facts, "config": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(r["kernel_matches_torch"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
