"""`kvgen bench`: store/load bandwidth of generated connectors, side by side with a plain
copy of the same bytes and a naive connector, plus the per-call cost of input checks.

For every selected (paged layout, memory object) connector and token count, one row per
direction (store = from_gpu, load = to_gpu) reports GB/s (bytes of KV moved / median
seconds), a flat `dst.copy_(src)` of the same byte count on the same device, and a naive
baseline written the usual way. Repeats of the three are interleaved so drift in the
machine's state hits all three alike. Before timing, each row checks once that the naive
baseline and the connector leave identical bits (object after a store, cache after a load).

The naive baseline reads only the spec facts (`kvgen.spec.library`), never the planner or the
generated code: per layer and per K/V plane it views the cache leaf as [B, N, H, C] (or
[S, H, C] for SGLang's folded slot axis), gathers the chunk's tokens with
`view[slot // N, slot % N]` (`index_select` over S), `torch.stack`s the planes and layers
into a temporary and copies that into the object; a load `index_put_`s (`index_copy_`
over S) each layer's plane of the object back at the same slots.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # kept out of import time: `kvgen build` imports this module for its CLI
    import random

#: Defaults from the issue: every MHA layout against kv_2ltd, the MLA layouts against
#: kv_mla, and each with its layerwise partner (kv_t2d, kv_mla_layer).
DEFAULT_LAYOUTS = ("vllm_flash_attn_nhd", "vllm_flash_attn_hnd", "vllm_flashinfer_nhd", "vllm_kv_tuple",
                   "vllm_cross_layer", "sglang_mha", "vllm_mla", "sglang_mla")
DEFAULT_OBJECTS = ("kv_2ltd", "kv_t2d", "kv_mla", "kv_mla_layer")
#: 8192 tokens is a 1 GiB object at the default geometry; on a 2-core CPU the full
#: default run would take well over the 3 minutes budgeted, so the default stops at 2048.
DEFAULT_TOKENS = (256, 2048)
MLA_C = 576

HEADERS = ("layout", "object", "mode", "tokens", "dir", "GB/s", "memcpy GB/s", "x memcpy", "naive GB/s",
           "x naive", "naive==kvgen")
CHECK_HEADERS = ("layout", "object", "bind fresh us", "bind cached us", "plan_chunk us")


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _tokens(text: str) -> list[int]:
    try:
        values = [int(t) for t in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens takes a comma list of integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"--tokens must be positive integers, got {text!r}")
    return values


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _nonnegative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layouts", type=_csv, default=list(DEFAULT_LAYOUTS), metavar="A,B",
                   help="paged layouts (names or aliases); default: " + ",".join(DEFAULT_LAYOUTS))
    p.add_argument("--objects", type=_csv, default=list(DEFAULT_OBJECTS), metavar="A,B",
                   help="memory objects; each layout is paired with those it has a connector for "
                        "(default: " + ",".join(DEFAULT_OBJECTS) + ")")
    p.add_argument("-L", "--layers", type=_positive, default=32)
    p.add_argument("--heads", type=_positive, default=8, help="KV heads (ignored by MLA layouts)")
    p.add_argument("--head-size", type=_positive, default=128, help=f"head size (MLA layouts use C = {MLA_C})")
    p.add_argument("--block-size", type=_positive, default=16, help="slots per block (N)")
    p.add_argument("--tokens", type=_tokens, default=list(DEFAULT_TOKENS), metavar="T,T",
                   help="tokens per chunk, comma list (default: " + ",".join(map(str, DEFAULT_TOKENS)) +
                        "; 8192 is 1 GiB per object at the default geometry)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--alloc", choices=("contiguous", "random"), default="random",
                   help="block allocation of the chunk: in order from block 0, or blocks in random order")
    p.add_argument("--device", default="cpu")
    p.add_argument("--warmup", type=_nonnegative, default=2)
    p.add_argument("--repeats", type=_positive, default=5, help="timed repeats; the median is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write all figures and machine facts")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                   help="draw the figures (needs matplotlib: pip install 'kvgen[plot]')")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


# -- the naive baseline: spec facts only ----------------------------------------------

Axes = tuple[tuple[str, ...], ...]


def _names(dims: Axes) -> list[str]:
    out = []
    for axes in dims:
        if not axes:
            out.append("1")
        elif axes == ("B", "N"):
            out.append("S")
        else:
            out.extend(axes)
    return out


def axes_view(dims: Axes, tensor: Any, ext: dict[str, int], fix: dict[str, int], order: Sequence[str]) -> Any:
    """`tensor` (dims as declared) as a view with one dim per axis of `order`: fused dims
    split, singletons and the axes in `fix` selected away, absent axes (KV, H) as size 1."""
    t = tensor
    for i in reversed(range(len(dims))):
        if len(dims[i]) > 1 and dims[i] != ("B", "N"):
            t = t.unflatten(i, tuple(ext[a] for a in dims[i]))
    names = _names(dims)
    for i in reversed(range(len(names))):
        if names[i] == "1" or names[i] in fix:
            t = t.select(i, fix.get(names[i], 0))
            del names[i]
    for axis in order:
        if axis not in names:
            t = t.unsqueeze(-1)
            names.append(axis)
    if sorted(names) != sorted(order):
        raise ValueError(f"cannot view axes {names} as {list(order)}")
    return t.permute(*[names.index(a) for a in order])


class NaiveConnector:
    """The usual hand-written connector, generic over layouts through their spec facts."""

    def __init__(self, paged: Any, obj: Any, ext: dict[str, int]):
        if any(a not in ("L", "KV") for a in paged.lists):
            raise ValueError(f"naive baseline: list level of {paged.lists} not supported")
        self.paged, self.obj, self.ext = paged, obj, ext
        self.pdims: Axes = tuple(d.axes for d in paged.dims)
        self.odims: Axes = tuple(d.axes for d in obj.dims)
        self.folded = any(d.is_slot for d in paged.dims)
        self.layerwise = "L" in obj.lists
        self.L, self.KV = ext["L"], ext["KV"] if paged.has("KV") else 1

    def _cache_view(self, kvcaches: Any, layer: int, kv: int) -> Any:
        fix = {"L": layer, "KV": kv}
        leaf = kvcaches
        for axis in self.paged.lists:
            leaf = leaf[fix[axis]]
        order = ("S", "H", "C") if self.folded else ("B", "N", "H", "C")
        return axes_view(self.pdims, leaf, self.ext, fix, order)

    def _object_view(self, tensor: Any, num_tokens: int, per_layer: bool) -> Any:
        ext = {**self.ext, "T": num_tokens}
        order = ("KV", "T", "H", "C") if per_layer else ("L", "KV", "T", "H", "C")
        return axes_view(self.odims, tensor, ext, {}, order)

    def _gather(self, view: Any, slots: Any, blk: Any, off: Any) -> Any:
        return view.index_select(0, slots) if self.folded else view[blk, off]

    def _scatter(self, view: Any, slots: Any, blk: Any, off: Any, rows: Any) -> None:
        if self.folded:
            view.index_copy_(0, slots, rows)
        else:
            view.index_put_((blk, off), rows)

    def _index(self, slot_mapping: Any, start: int, end: int) -> tuple[Any, Any, Any]:
        slots = slot_mapping[start:end].long()
        n = self.ext["N"]
        return slots, slots // n, slots % n

    def store(self, objects: Any, start: int, end: int, kvcaches: Any, slot_mapping: Any) -> None:
        """`objects`: one tensor, or a per-layer list of tensors (layerwise objects)."""
        import torch

        slots, blk, off = self._index(slot_mapping, start, end)
        layers = []
        for layer in range(self.L):
            planes = [self._gather(self._cache_view(kvcaches, layer, kv), slots, blk, off) for kv in range(self.KV)]
            stacked = torch.stack(planes)  # [KV T H C]
            if self.layerwise:
                self._object_view(objects[layer], end - start, True).copy_(stacked)
            else:
                layers.append(stacked)
        if not self.layerwise:
            self._object_view(objects, end - start, False).copy_(torch.stack(layers))  # [L KV T H C]

    def load(self, objects: Any, start: int, end: int, kvcaches: Any, slot_mapping: Any) -> None:
        slots, blk, off = self._index(slot_mapping, start, end)
        whole = None if self.layerwise else self._object_view(objects, end - start, False)
        for layer in range(self.L):
            part = self._object_view(objects[layer], end - start, True) if whole is None else whole[layer]
            for kv in range(self.KV):
                self._scatter(self._cache_view(kvcaches, layer, kv), slots, blk, off, part[kv])


# -- setup ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    layout: str
    obj: str
    mode: str


def _generated() -> Any:
    """The generated package: installed as kvgen.generated, else the repository's generated/."""
    for name in ("kvgen.generated", "generated"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            pass
    from kvgen.spec.library import REPO_ROOT

    sys.path.insert(0, str(REPO_ROOT))
    return importlib.import_module("generated")


def select_targets(library: Any, gen: Any, layouts: Sequence[str], objects: Sequence[str]) -> list[Target]:
    targets = []
    for name in layouts:
        spec = library[name]
        if not spec.is_paged:
            raise KeyError(f"{name!r} is a memory object, not a paged layout")
        for oname in objects:
            obj = library[oname]
            if obj.is_paged:
                raise KeyError(f"{oname!r} is a paged layout, not a memory object")
            if (spec.name, obj.name) not in gen.CONNECTORS:
                continue
            cls = gen.get(spec.name, obj.name)
            targets.append(Target(spec.name, obj.name, "layerwise" if cls.layerwise else "whole"))
    if not targets:
        raise KeyError(f"no generated connector pairs layouts {', '.join(layouts)} with objects {', '.join(objects)}")
    return targets


def extents(spec: Any, args: argparse.Namespace, num_blocks: int) -> dict[str, int]:
    mla = not spec.has("H")
    return {"L": args.layers, "KV": 2 if spec.has("KV") else 1, "H": 1 if mla else args.heads,
            "C": MLA_C if mla else args.head_size, "N": args.block_size, "B": num_blocks}


def slot_mapping(num_tokens: int, num_blocks: int, block_size: int, alloc: str, rng: random.Random) -> list[int]:
    """vLLM-style block table: the chunk fills ceil(T / N) blocks, from block 0 in order
    (contiguous) or a random sample of the cache's blocks in random order (random)."""
    need = -(-num_tokens // block_size)
    blocks = list(range(need)) if alloc == "contiguous" else rng.sample(range(num_blocks), need)
    return [blocks[i // block_size] * block_size + i % block_size for i in range(num_tokens)]


def _fill_random(t: Any, gen: Any) -> None:
    import torch

    if t.dtype.is_floating_point:
        if t.element_size() >= 2:
            t.copy_(torch.randn(t.shape, dtype=t.dtype, generator=gen, device="cpu"))
        else:
            t.copy_(torch.randn(t.shape, generator=gen, device="cpu").to(t.dtype))
    else:
        info = torch.iinfo(t.dtype)
        t.copy_(torch.randint(info.min, info.max, t.shape, generator=gen, device="cpu", dtype=t.dtype))


def _tensors(tree: Any) -> list[Any]:
    if isinstance(tree, (list, tuple)):
        return [t for sub in tree for t in _tensors(sub)]
    return [tree]


def _same_bits(a: Any, b: Any) -> bool:
    import torch

    from kvgen.runtime import bits

    return all(torch.equal(bits(x), bits(y)) for x, y in zip(_tensors(a), _tensors(b), strict=True))


def _clone(tree: Any) -> Any:
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(t) for t in tree)
    return tree.clone()


# -- timing --------------------------------------------------------------------------


def _median_seconds(fns: dict[str, Callable[[], None]], sync: Callable[[], None], warmup: int,
                    repeats: int) -> dict[str, float]:
    """Median seconds of each function; repeats interleaved across the functions."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
            sync()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[key].append(time.perf_counter() - t0)
    import statistics

    return {k: statistics.median(v) for k, v in times.items()}


def _micro(fn: Callable[[], Any], iters: int, setup: Callable[[], Any] | None = None) -> float:
    """Median microseconds of one call of fn(arg), arg from setup() outside the timing."""
    samples = []
    for _ in range(iters):
        arg = setup() if setup else None
        t0 = time.perf_counter()
        fn(arg) if setup else fn()
        samples.append(time.perf_counter() - t0)
    import statistics

    return statistics.median(samples) * 1e6


@dataclass
class Row:
    layout: str
    obj: str
    mode: str
    tokens: int
    dir: str
    bytes: int
    seconds: float
    gbps: float
    memcpy_gbps: float
    ratio_memcpy: float
    naive_gbps: float
    speedup_naive: float
    naive_matches: bool

    def cells(self) -> tuple[str, ...]:
        return (self.layout, self.obj, self.mode, str(self.tokens), self.dir, f"{self.gbps:.2f}",
                f"{self.memcpy_gbps:.2f}", f"{self.ratio_memcpy:.2f}", f"{self.naive_gbps:.2f}",
                f"{self.speedup_naive:.2f}", "yes" if self.naive_matches else "NO")


@dataclass
class CheckCost:
    layout: str
    obj: str
    bind_fresh_us: float
    bind_cached_us: float
    plan_chunk_us: dict[str, float]

    def cells(self) -> tuple[str, ...]:
        plan = ", ".join(f"T={t}: {us:.1f}" for t, us in self.plan_chunk_us.items())
        return (self.layout, self.obj, f"{self.bind_fresh_us:.1f}", f"{self.bind_cached_us:.2f}", plan)


class _Transfers:
    """Store and load of one chunk [0, T) through the generated connector and the naive one."""

    def __init__(self, connector: Any, naive: NaiveConnector, cache: Any, mapping: Any, num_tokens: int,
                 device: Any, dtype: Any):
        import torch

        from kvgen.runtime import MemoryObj

        self.c, self.naive, self.cache, self.mapping, self.T = connector, naive, cache, mapping, num_tokens
        self.cache_device = device
        shape = connector.get_shape(num_tokens)
        count = connector.geometry.L if connector.layerwise else 1
        tensors = [torch.empty(shape, dtype=dtype, device=device) for _ in range(count)]
        self.objs = [MemoryObj(t, connector.format) for t in tensors]
        naive_tensors = [torch.empty(shape, dtype=dtype, device=device) for _ in range(count)]
        self.naive_objs = naive_tensors if connector.layerwise else naive_tensors[0]
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
        self.naive.store(self.naive_objs, 0, self.T, self.cache, self.mapping)

    def naive_load(self) -> None:
        self.naive.load(self.tensors(), 0, self.T, self.cache, self.mapping)

    def check_store(self) -> bool:
        self.store()
        self.naive_store()
        return _same_bits(self.tensors(), self.naive_objs)

    def check_load(self) -> bool:
        from kvgen.runtime import bits

        for t in _tensors(self.tensors()):
            bits(t).bitwise_not_()  # after check_store: every element now differs from its cache slot
        twin = _clone(self.cache)
        self.load()
        self.naive.load(self.tensors(), 0, self.T, twin, self.mapping)
        same = _same_bits(self.cache, twin)
        del twin
        return same


# -- the run -------------------------------------------------------------------------


def machine_facts(device: str) -> dict[str, Any]:
    import datetime
    import platform

    import torch

    from kvgen import __version__

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    facts = {"platform": platform.platform(), "python": platform.python_version(), "cpu_model": cpu,
             "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
             "device": device, "kvgen": __version__,
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if device.startswith("cuda") and torch.cuda.is_available():
        facts["device_name"] = torch.cuda.get_device_name(torch.device(device))
    return facts


def check_cost(target: Target, cls: type, cache: Any, mappings: dict[int, Any], device: Any) -> CheckCost:
    """Per-call cost of the runtime's input checks: bind on a fresh connector (reads and
    checks the cache's geometry), bind again with the same cache (cached), plan_chunk."""
    from kvgen.runtime import plan_chunk

    warm = cls(device=device)
    g = warm.bind(cache)
    fresh = _micro(lambda c: c.bind(cache), 50, setup=lambda: cls(device=device))
    cached = _micro(lambda: warm.bind(cache), 500)
    plan = {str(t): _micro(lambda m=m, t=t: plan_chunk(m, 0, t, num_slots=g.S, block_size=g.N), 50)
            for t, m in mappings.items()}
    return CheckCost(target.layout, target.obj, fresh, cached, plan)


def measure(target: Target, xfer: _Transfers, sync: Callable[[], None], args: argparse.Namespace) -> list[Row]:
    """Store and load rows of one connector and token count: check, then time."""
    import torch

    # Both buffers are written first: reading never-touched memory maps the zero page and
    # would make the plain copy look faster than any real copy can be.
    src = torch.ones(xfer.nbytes, dtype=torch.uint8, device=xfer.cache_device)
    dst = torch.zeros_like(src)

    def memcpy() -> None:
        dst.copy_(src)

    rows = []
    for direction in ("store", "load"):
        if direction == "store":
            same = xfer.check_store()
            fns = {"kvgen": xfer.store, "memcpy": memcpy, "naive": xfer.naive_store}
        else:
            same = xfer.check_load()
            fns = {"kvgen": xfer.load, "memcpy": memcpy, "naive": xfer.naive_load}
        sec = _median_seconds(fns, sync, args.warmup, args.repeats)
        gb = {k: xfer.nbytes / s / 1e9 for k, s in sec.items()}
        rows.append(Row(target.layout, target.obj, target.mode, xfer.T, direction, xfer.nbytes, sec["kvgen"],
                        gb["kvgen"], gb["memcpy"], gb["kvgen"] / gb["memcpy"], gb["naive"], gb["kvgen"] / gb["naive"],
                        same))
    return rows


def _random_tensor(shape: tuple[int, ...], dtype: Any, device: Any, gen: Any) -> Any:
    import torch

    t = torch.empty(shape, dtype=dtype, device=device)
    _fill_random(t, gen)
    return t


def run(args: argparse.Namespace, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure everything `args` selects; returns the figures as plain data."""
    import torch

    from kvgen.oracle.reference import leaf_shape, nest
    from kvgen.runtime import backend_for
    from kvgen.spec.library import load_library

    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {args.dtype!r}")
    device = torch.device(args.device)
    backend = backend_for(device)

    def sync() -> None:
        backend.synchronize(backend.current_stream())

    library = load_library()
    gen = _generated()
    targets = select_targets(library, gen, args.layouts, args.objects)
    tokens = list(args.tokens)
    max_t = max(tokens)
    num_blocks = -(-max_t * 5 // (4 * args.block_size))  # 25% spare blocks for random allocation
    total = len(targets) * len(tokens) * 2
    rows: list[Row] = []
    checks: list[CheckCost] = []
    import random

    rng = random.Random(args.seed)
    tgen = torch.Generator().manual_seed(args.seed)

    for layout in dict.fromkeys(t.layout for t in targets):
        paged = library[layout]
        ext = extents(paged, args, num_blocks)
        shape = leaf_shape(paged, ext)
        cache = nest(paged, ext, lambda path, shape=shape: _random_tensor(shape, dtype, device, tgen))
        mappings = {t: torch.tensor(slot_mapping(t, num_blocks, args.block_size, args.alloc, rng),
                                    dtype=torch.long, device=device) for t in tokens}
        for target in (t for t in targets if t.layout == layout):
            cls = gen.get(target.layout, target.obj)
            connector = cls(device=device)
            connector.bind(cache)
            naive = NaiveConnector(paged, library[target.obj], ext)
            checks.append(check_cost(target, cls, cache, mappings, device))
            for t in tokens:
                xfer = _Transfers(connector, naive, cache, mappings[t], t, device, dtype)
                for row in measure(target, xfer, sync, args):
                    rows.append(row)
                    if progress:
                        progress(f"[{len(rows)}/{total}] {row.layout} {row.obj} T={t} {row.dir}: "
                                 f"{row.gbps:.2f} GB/s (memcpy {row.memcpy_gbps:.2f}, naive {row.naive_gbps:.2f}, "
                                 f"naive==kvgen {'yes' if row.naive_matches else 'NO'})")

    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k not in ("run", "command", "json", "plot", "quiet")}
    config["num_blocks"] = num_blocks
    return {"machine": machine_facts(str(device)), "config": config,
            "rows": [asdict(r) for r in rows], "check_costs": [asdict(c) for c in checks],
            "_rows": rows, "_checks": checks}


def table(headers: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]
    right = [i for i, h in enumerate(headers) if "/s" in h or h.startswith("x ") or h in ("tokens",) or "us" in h]

    def line(values: Sequence[str]) -> str:
        cells = [v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths, strict=True))]
        return "  ".join(cells).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(c) for c in cells)])


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    tokens = sorted({r["tokens"] for r in rows})
    dirs = ("store", "load")
    fig, axes = plt.subplots(len(tokens), 2, figsize=(14, 3.6 * len(tokens)), squeeze=False)
    for i, t in enumerate(tokens):
        for j, d in enumerate(dirs):
            ax = axes[i][j]
            sel = [r for r in rows if r["tokens"] == t and r["dir"] == d]
            xs = range(len(sel))
            width = 0.27
            for k, (key, label) in enumerate((("gbps", "kvgen"), ("naive_gbps", "naive"), ("memcpy_gbps", "memcpy"))):
                ax.bar([x + (k - 1) * width for x in xs], [r[key] for r in sel], width, label=label)
            ax.set_xticks(list(xs))
            ax.set_xticklabels([f"{r['layout']}\n{r['obj']}" for r in sel], rotation=60, ha="right", fontsize=7)
            ax.set_ylabel("GB/s")
            ax.set_title(f"{d}, T={t}")
            ax.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(f"kvgen bench on {m['device']} ({m['cpu_model']}, {m['cpu_count']} CPUs, torch {m['torch']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        print("kvgen bench: --plot needs matplotlib, which is not installed; "
              "install it with `pip install 'kvgen[plot]'` (or drop --plot)", file=sys.stderr)
        return 2
    from kvgen.runtime import available_devices

    present = available_devices()
    if args.device.split(":")[0] not in present:
        print(f"kvgen bench: device {args.device} is not available here (present: {', '.join(present)})",
              file=sys.stderr)
        return 2
    progress = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        result = run(args, progress)
    except (KeyError, ValueError) as exc:
        print(f"kvgen bench: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    rows: list[Row] = result.pop("_rows")
    checks: list[CheckCost] = result.pop("_checks")
    m = result["machine"]
    c = result["config"]
    print(f"kvgen bench: {m['device']}, {m['cpu_model']}, {m['cpu_count']} CPUs, torch {m['torch']}; "
          f"L={c['layers']} H={c['heads']} C={c['head_size']} (MLA: C={MLA_C}) N={c['block_size']} "
          f"{c['dtype']}, {c['alloc']} blocks, median of {c['repeats']} (warmup {c['warmup']})")
    print()
    print(table(HEADERS, [r.cells() for r in rows]))
    print()
    print("Input-check cost per call (median microseconds): bind on a fresh connector, bind again "
          "with the same cache (cached), plan_chunk per chunk")
    print(table(CHECK_HEADERS, [k.cells() for k in checks]))
    bad = [r for r in rows if not r.naive_matches]
    print()
    if bad:
        print(f"naive baseline DISAGREED with the connector on {len(bad)} of {len(rows)} rows")
    else:
        print(f"naive baseline agreed bit for bit with the connector on all {len(rows)} rows")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    if args.plot is not None:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 1 if bad else 0


__all__ = ["NaiveConnector", "add_arguments", "axes_view", "main", "run", "table"]
