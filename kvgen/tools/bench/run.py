"""One bench run: build the caches and objects of the selection, check once that the naive
baseline and each connector leave the same bits, then time the three contenders and the
connector's input checks."""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvgen.oracle.reference.layouts import leaf_shape, nest
from kvgen.oracle.reference.planes import nest_parts, part_shape, storage_dtype
from kvgen.oracle.scenarios import clone_tree, same_bits, tensors_of
from kvgen.runtime import MemoryObj, backend_for, bits, plan_chunk
from kvgen.runtime.aliasing import check_objects_apart, check_unique_slots
from kvgen.spec.library import load_library
from kvgen.tools.bench import models as bench_models
from kvgen.tools.bench import transfers as bench_transfers
from kvgen.tools.bench.baseline import NaiveConnector, memcpy
from kvgen.tools.bench.measure import CheckCost, Row, micro, peak_extra_bytes, timed_repeats
from kvgen.tools.bench.targets import (
    BenchContext,
    Target,
    connector_package,
    extents,
    select_targets,
    slot_mapping,
)


def fill_random(t: torch.Tensor, gen: torch.Generator) -> None:
    """Random values of t's dtype (drawn on the CPU, so a seed gives the same cache anywhere)."""
    if t.dtype.is_floating_point:
        if t.element_size() >= 2:
            t.copy_(torch.randn(t.shape, dtype=t.dtype, generator=gen, device="cpu"))
        else:  # fp8: randn has no kernel for it
            t.copy_(torch.randn(t.shape, generator=gen, device="cpu").to(t.dtype))
    else:
        info = torch.iinfo(t.dtype)
        t.copy_(torch.randint(info.min, info.max, t.shape, generator=gen, device="cpu", dtype=t.dtype))


def make_cache(paged: Any, ext: dict[str, int], dtype: torch.dtype, device: Any, gen: torch.Generator) -> Any:
    """A cache of random values: every leaf in `dtype`, or each part of a cache of several
    planes in its own dtype (`dtype` where the part allows it)."""
    def filled(shape: tuple[int, ...], leaf_dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=leaf_dtype, device=device)
        fill_random(t, gen)
        return t

    if paged.is_simple:
        shape = leaf_shape(paged, ext)
        return nest(paged, ext, lambda path: filled(shape, dtype))
    name = str(dtype).removeprefix("torch.")
    return nest_parts(paged, ext, lambda path, part: filled(part_shape(paged, part, ext),
                                                            getattr(torch, storage_dtype(part, name))))


class Transfers:
    """Store and load of one chunk [0, T) through the generated connector and the naive one
    (None for caches of several planes or several slots per token, which have no naive baseline)."""

    def __init__(self, connector: Any, naive: NaiveConnector | None, cache: Any, mapping: torch.Tensor,
                 num_tokens: int, dtype: torch.dtype):
        self.c, self.naive, self.cache, self.mapping, self.T = connector, naive, cache, mapping, num_tokens
        self.cache_device = device = mapping.device  # the slot mapping lives with the cache
        shape = connector.get_shape(num_tokens)
        count = connector.geometry.L if connector.layerwise else 1
        if getattr(connector.memory, "pack", None) is not None:
            dtype = connector.get_dtype()  # a packed object has its own dtype (bytes for regions)
        # zeroed: a copy does not write the padding between the regions of a packed object
        tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
        self.objs = [MemoryObj(t, connector.format) for t in tensors]
        naive_tensors = [torch.empty(shape, dtype=dtype, device=device) for _ in range(count if naive else 0)]
        self.naive_objs = naive_tensors if connector.layerwise or not naive else naive_tensors[0]
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def tensors(self) -> Any:
        return [o.tensor for o in self.objs] if self.c.layerwise else self.objs[0].tensor

    def store(self) -> None:
        kw = {"kvcaches": self.cache, "slot_mapping": self.mapping}
        if self.c.layerwise:
            for _ in self.c.batched_from_gpu([[o] for o in self.objs], [0], [self.T], **kw):
                pass
        else:
            self.c.from_gpu(self.objs[0], 0, self.T, **kw)

    def load(self) -> None:
        kw = {"kvcaches": self.cache, "slot_mapping": self.mapping}
        if self.c.layerwise:
            gen = self.c.batched_to_gpu([0], [self.T], **kw)
            next(gen)
            for o in self.objs:
                gen.send([o])
            next(gen)
        else:
            self.c.to_gpu(self.objs[0], 0, self.T, **kw)

    def naive_store(self) -> None:
        assert self.naive is not None
        self.naive.store(self.naive_objs, 0, self.T, self.cache, self.mapping)

    def naive_load(self) -> None:
        assert self.naive is not None
        self.naive.load(self.tensors(), 0, self.T, self.cache, self.mapping)

    def check_store(self) -> bool | None:
        self.store()
        if self.naive is None:
            return None
        self.naive_store()
        return same_bits(self.tensors(), self.naive_objs)

    def check_load(self) -> bool | None:
        if self.naive is None:
            self.load()
            return None
        for t in tensors_of(self.tensors()):
            bits(t).bitwise_not_()  # after check_store: every element now differs from its cache slot
        twin = clone_tree(self.cache)
        self.load()
        self.naive.load(self.tensors(), 0, self.T, twin, self.mapping)
        return same_bits(self.cache, twin)


def transfer_rows(target: Target, xfer: Transfers, sync: Callable[[], None], warmup: int, repeats: int) -> list[Row]:
    """Store and load rows of one connector and token count: check, then time."""
    copy = memcpy(xfer.nbytes, xfer.cache_device)
    rows = []
    for direction in ("store", "load"):
        if direction == "store":
            same = xfer.check_store()
            fns = {"kvgen": xfer.store, "memcpy": copy, "naive": xfer.naive_store}
        else:
            same = xfer.check_load()
            fns = {"kvgen": xfer.load, "memcpy": copy, "naive": xfer.naive_load}
        if xfer.naive is None:
            del fns["naive"]
        seconds = timed_repeats(fns, sync, warmup, repeats)
        peak = peak_extra_bytes(fns["kvgen"]) if xfer.cache_device.type == "cpu" else None
        rows.append(Row(target.layout, target.obj, target.mode, xfer.T, direction, xfer.nbytes, seconds, same,
                        xfer.c.copy_backend_for(xfer.cache_device), peak))
    return rows


def check_cost(target: Target, cls: type, cache: Any, mappings: dict[int, torch.Tensor], device: Any) -> CheckCost:
    """Per-call cost of the runtime's input checks. To time another check, add an entry."""
    warm = cls(device=device)
    g = warm.bind(cache)
    us = {
        # reads and checks the cache's geometry on a connector that has seen no cache
        "bind fresh": micro(lambda c: c.bind(cache), 50, setup=lambda: cls(device=device)),
        # the same cache again: what every transfer call pays
        "bind cached": micro(lambda: warm.bind(cache), 500),
    }
    binding, _ = warm._bind(cache)
    for t, m in mappings.items():
        us[f"plan_chunk T={t}"] = micro(lambda m=m, t=t: plan_chunk(m, 0, t, g), 50)
        # a chunk's objects apart from each other and from the cache (per layer when layerwise)
        objects = [torch.empty(warm.get_shape(t), dtype=g.dtype, device=device)
                   for _ in range(g.L if warm.layerwise else 1)]
        us[f"objects apart T={t}"] = micro(
            lambda o=objects: check_objects_apart(o, str, binding.memory, binding.names), 50)
        # a load writes each slot from one token at most
        us[f"unique slots T={t}"] = micro(lambda m=m, t=t: check_unique_slots(m, [(0, t)], 0), 50)
    return CheckCost(target.layout, target.obj, us)


@dataclass
class Result:
    config: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    checks: list[CheckCost] = field(default_factory=list)
    #: Layout-to-layout transfer rows (kvgen.tools.bench.transfers).
    transfers: list[Any] = field(default_factory=list)
    #: Model connector rows (kvgen.tools.bench.models).
    models: list[Any] = field(default_factory=list)


def _layout_rows(ctx: BenchContext, layout: str, targets: list[Target], result: Result,
                 progress: Callable[[Row, int, int], None] | None) -> None:
    """Check costs and rows of every selected connector of one layout, on one cache of random values."""
    args, device, paged = ctx.args, ctx.device, ctx.library[layout]
    dtype, num_blocks = getattr(torch, args.dtype), result.config["num_blocks"]
    ext = extents(paged, args.layers, args.heads, args.head_size, args.block_size, num_blocks)
    cache = make_cache(paged, ext, dtype, device, ctx.values)
    mappings = {t: torch.tensor(slot_mapping(t, num_blocks, args.block_size, args.alloc, ctx.rng),
                                dtype=torch.long, device=device) for t in args.tokens}
    backends = list(getattr(args, "backend", None) or ["auto"])
    total = len(targets) * len(args.tokens) * 2 * len(backends)
    for target in (t for t in targets if t.layout == layout):
        cls = ctx.package.get(target.layout, target.obj)
        # the naive connector moves one row per token: none for a layout of several slots per token
        simple = paged.is_simple and paged.token_ratio == (1, 1)
        naive = NaiveConnector(paged, ctx.library[target.obj], ext) if simple else None
        result.checks.append(check_cost(target, cls, cache, mappings, device))
        for name in backends:
            connector = cls(device=device, backend=None if name == "auto" else name)
            connector.bind(cache)
            for t in args.tokens:
                xfer = Transfers(connector, naive, cache, mappings[t], t, dtype)
                for row in transfer_rows(target, xfer, ctx.sync, args.warmup, args.repeats):
                    result.rows.append(row)
                    if progress:
                        progress(row, len(result.rows), total)


def run(args: argparse.Namespace, progress: Callable[[Row, int, int], None] | None = None) -> Result:
    """Measure everything `args` selects."""
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {args.dtype!r}")
    device = torch.device(args.device)
    backend = backend_for(device)

    def sync() -> None:
        backend.synchronize(backend.current_stream())

    specs = list(args.specs)
    library = load_library(specs)
    num_blocks = -(-max(args.tokens) * 5 // (4 * args.block_size))  # 25% spare blocks for random allocation
    config = {k: ([str(p) for p in v] if k == "specs" else str(v) if isinstance(v, Path) else v)
              for k, v in vars(args).items() if k not in ("run", "command", "json", "plot", "quiet")}
    result = Result({**config, "num_blocks": num_blocks})
    tgen = torch.Generator().manual_seed(args.seed)
    with connector_package(specs) as package:
        ctx = BenchContext(args, library, package, device, sync, random.Random(args.seed), tgen, progress is not None)
        targets = select_targets(library, package, args.layouts, args.objects)
        moves = bench_transfers.select(args.transfers, library, package)
        chosen = bench_models.select(getattr(args, "models", "none"), library)
        for layout in dict.fromkeys(t.layout for t in targets):
            _layout_rows(ctx, layout, targets, result, progress)
        result.transfers = bench_transfers.rows(moves, ctx, dtype, num_blocks, lambda t: fill_random(t, tgen))
        result.models = bench_models.rows(chosen, ctx)
    return result
