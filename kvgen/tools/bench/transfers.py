"""Transfer rows of `kvgen bench`: a generated layout-to-layout transfer against a plain copy
of the same bytes (memcpy) and against the two-copy path a system without it takes (store the
source cache's tokens into a memory object with the source layout's connector, load them into
the destination cache with the destination layout's connector), in one run.

The three contenders run in rotated order on every repeat; ratios are paired per repeat, as in
the connector rows. Before timing, each row checks that the direct transfer and the two-copy
path leave the destination cache bit for bit the same. Every pair is measured whole (`copy`)
and layer by layer (`copy_layers`), on each copy path --backend names (auto, native, torch),
with the peak extra memory of one call on the CPU.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvgen.errors import KVLayoutError
from kvgen.oracle.reference.layouts import leaf_shape, nest
from kvgen.oracle.scenarios import clone_tree, same_bits
from kvgen.runtime import MemoryObj
from kvgen.tools.bench.baseline import memcpy
from kvgen.tools.bench.measure import Spread, Timed, paired_ratios, peak_extra_bytes, timed_repeats
from kvgen.tools.bench.targets import BenchContext, extents, slot_mapping
from kvgen.tools.bench.text_table import table

HEADERS = ("source", "destination", "tokens", "mode", "backend", "GB/s", "memcpy GB/s", "x memcpy min-med-max",
           "two-copy GB/s", "x two-copy min-med-max", "via object", "peak MiB", "memcpy var", "direct==two-copy")
#: How a row calls the transfer: every layer in one call, or one layer per generator step.
MODES = ("whole", "layers")


@dataclass(frozen=True)
class TransferRow(Timed):
    src: str
    dst: str
    tokens: int
    bytes: int
    #: The memory object of the two-copy path (None: no whole-chunk object serves both layouts).
    via: str | None
    seconds: Mapping[str, Sequence[float]]
    matches: bool
    mode: str = "whole"
    #: The copy path asked for (auto: what a transfer picks by default) and the one that ran.
    backend: str = "auto"
    #: Peak resident bytes one call takes beyond those before it (CPU only; None elsewhere).
    peak: int | None = None

    @property
    def x_two_copy(self) -> Spread | None:
        """The direct transfer's speedup over store-then-load, per repeat."""
        return paired_ratios(self.seconds["two-copy"], self.seconds["kvgen"]) if self.via else None

    def cells(self) -> tuple[str, ...]:
        var = f"{self.memcpy_variation * 100:.0f}%" + (" !" if self.memcpy_unstable else "  ")
        two = self.x_two_copy
        peak = f"{self.peak / 2**20:.1f}" if self.peak is not None else "-"
        return (self.src, self.dst, str(self.tokens), self.mode, self.backend, f"{self.gbps():.2f}",
                f"{self.gbps('memcpy'):.2f}", self.x_memcpy.cell(), f"{self.gbps('two-copy'):.2f}" if two else "-",
                two.cell() if two else "-", self.via or "-", peak, var, "yes" if self.matches else "NO")

    def as_dict(self) -> dict[str, object]:
        two = self.x_two_copy
        return {"src": self.src, "dst": self.dst, "tokens": self.tokens, "mode": self.mode, "backend": self.backend,
                "peak_extra_bytes": self.peak, "bytes": self.bytes, "via": self.via,
                "gbps": self.gbps(), "memcpy_gbps": self.gbps("memcpy"),
                "two_copy_gbps": self.gbps("two-copy") if two else None, "x_memcpy": vars(self.x_memcpy),
                "x_two_copy": vars(two) if two else None, "memcpy_variation": self.memcpy_variation,
                "matches": self.matches, "repeat_seconds": {k: list(v) for k, v in self.seconds.items()}}


def parse(text: str) -> list[tuple[str, str]]:
    """`A:B,C:D` -> [(A, B), (C, D)]; `none` (or nothing) -> no transfer rows."""
    if text.strip().lower() in ("", "none"):
        return []
    pairs = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        src, sep, dst = item.partition(":")
        if not sep or not src or not dst:
            raise ValueError(f"--transfers takes SOURCE:DESTINATION pairs separated by commas, got {item!r}")
        pairs.append((src, dst))
    return pairs


def _via(package: Any, library: Any, src: str, dst: str) -> tuple[str, type, type] | None:
    """A whole-chunk memory object both layouts have connectors for: the two-copy path's."""
    for obj in library.objects:
        classes = []
        for layout in (src, dst):
            try:
                cls = package.get(layout, obj.name)
            except KVLayoutError:
                break
            if cls.layerwise:
                break
            classes.append(cls)
        if len(classes) == 2:
            return obj.name, classes[0], classes[1]
    return None


def select(text: str, library: Any, package: Any) -> list[tuple[Any, Any, type]]:
    """(source spec, destination spec, transfer class) of each pair `text` names; a name that
    is not a layout, or a pair with no generated transfer, raises before anything is measured."""
    out = []
    for src_name, dst_name in parse(text):
        src, dst = library[src_name], library[dst_name]
        out.append((src, dst, package.transfer(src.name, dst.name)))
    return out


def rows(moves: Sequence[tuple[Any, Any, type]], ctx: BenchContext, dtype: torch.dtype, num_blocks: int,
         fill: Callable[[torch.Tensor], None]) -> list[TransferRow]:
    """Measure every selected transfer at every token count."""
    args, device = ctx.args, ctx.device
    out: list[TransferRow] = []
    for src, dst, T in moves:
        caches = []
        for spec in (src, dst):
            ext = extents(spec, args.layers, args.heads, args.head_size, args.block_size, num_blocks)
            shape = leaf_shape(spec, ext)

            def make(path: Any, shape: tuple[int, ...] = shape) -> torch.Tensor:
                t = torch.empty(shape, dtype=dtype, device=device)
                fill(t)
                return t

            caches.append(nest(spec, ext, make))
        via = _via(ctx.package, ctx.library, src.name, dst.name)
        for tokens in args.tokens:
            maps = [torch.tensor(slot_mapping(tokens, num_blocks, args.block_size, args.alloc, ctx.rng), device=device)
                    for _ in range(2)]
            sides = ((caches[0], maps[0]), (caches[1], maps[1]))
            for backend in _backends(args, device):
                for mode in MODES:
                    transfer = T(copy_backend=None if backend == "auto" else backend)
                    row = _row(ctx, transfer, mode, via, sides, tokens)
                    out.append(TransferRow(src.name, dst.name, tokens, row[0], via[0] if via else None, row[1],
                                           row[2], mode, backend, row[3]))
                    if ctx.progress:
                        r = out[-1]
                        print(f"[transfer {len(out)}] {r.src} -> {r.dst} T={tokens} {mode} ({backend}): "
                              f"{r.gbps():.2f} GB/s (memcpy {r.gbps('memcpy'):.2f}, two-copy "
                              f"{r.gbps('two-copy') if r.via else float('nan'):.2f}, direct==two-copy "
                              f"{'yes' if r.matches else 'NO'})", file=sys.stderr, flush=True)
    return out


def _backends(args: Any, device: torch.device) -> list[str]:
    """The copy paths --backend names that a transfer has: auto, native (CPU only), torch."""
    asked = list(getattr(args, "backend", None) or ["auto"])
    return [b for b in asked if b in ("auto", "torch") or (b == "native" and device.type == "cpu")]


#: A transfer's side: a cache and the slots of the chunk's tokens in it.
Side = tuple[Any, torch.Tensor]


def _row(ctx: BenchContext, transfer: Any, mode: str, via: tuple[str, type, type] | None, sides: tuple[Side, Side],
         tokens: int) -> tuple[int, dict[str, list[float]], bool, int | None]:
    """(bytes moved, seconds per contender, whether the direct copy and the two-copy agree, peak bytes)."""
    (src, s), (dst, d) = sides
    device = ctx.device
    gs, _ = transfer.check(src, dst)
    size = torch.empty(0, dtype=gs.dtype).element_size()
    nbytes = tokens * gs.L * gs.KV * gs.H * gs.C * size

    def direct() -> None:
        if mode == "whole":
            transfer.copy(src, s, dst, d)
        else:
            for _ in transfer.copy_layers(src, s, dst, d):
                pass

    fns: dict[str, Callable[[], None]] = {"kvgen": direct, "memcpy": memcpy(nbytes, device)}
    matches = True
    if via is not None:
        store, load = via[1](device=device), via[2](device=device)
        obj = MemoryObj(torch.empty(tuple(store.get_shape(tokens, src)), dtype=gs.dtype, device=device))

        def two_copy(into: Any = dst) -> None:
            store.from_gpu(obj, 0, tokens, kvcaches=src, slot_mapping=s)
            load.to_gpu(obj, 0, tokens, kvcaches=into, slot_mapping=d)

        fns["two-copy"] = two_copy
        twin = clone_tree(dst)
        direct()
        two_copy(twin)
        matches = same_bits(dst, twin)
    seconds = timed_repeats(fns, ctx.sync, ctx.args.warmup, ctx.args.repeats)
    return nbytes, seconds, matches, peak_extra_bytes(direct) if device.type == "cpu" else None


def text(found: Sequence[TransferRow]) -> list[str]:
    lines = ["", "Layout-to-layout transfers: the generated transfer (GB/s of KV moved), a plain copy of the same "
             "bytes, and the two-copy path (store into the object, then load from it)",
             table(HEADERS, [r.cells() for r in found]),
             "x memcpy = memcpy seconds / transfer seconds, x two-copy = two-copy seconds / transfer seconds, "
             "each of the same repeat"]
    bad = sum(1 for r in found if not r.matches)
    lines.append(f"direct transfer and two-copy path DISAGREED on {bad} of {len(found)} rows" if bad else
                 f"direct transfer and two-copy path agreed bit for bit on all {len(found)} rows")
    return lines
