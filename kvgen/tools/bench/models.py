"""Model rows of `kvgen bench`: a generated model connector (every group of a model with its
own block table, and one request's state) against a plain copy of the same bytes (memcpy) and
against the per-group path a system without it takes (each group's own whole-chunk connector
into its section, then each state tensor's row copied by hand), in one run.

The three contenders run in rotated order on every repeat and ratios are paired per repeat,
as in the connector rows. Before timing, each row checks that the model connector and the
per-group path leave the same bits (the object on a store, every cache and state tensor on a
load). Geometry is the model's own (its declared heads, head sizes and layer count).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvgen.oracle.reference import models as oracle
from kvgen.oracle.scenarios import clone_tree, same_bits
from kvgen.oracle.scenarios.models import make_kvcaches
from kvgen.runtime import MemoryObj
from kvgen.tools.bench.baseline import memcpy
from kvgen.tools.bench.measure import Spread, Timed, paired_ratios, peak_extra_bytes, timed_repeats
from kvgen.tools.bench.targets import BenchContext, slot_mapping
from kvgen.tools.bench.text_table import table

HEADERS = ("model", "object", "tokens", "dir", "GB/s", "memcpy GB/s", "x memcpy min-med-max", "per-group GB/s",
           "x per-group min-med-max", "peak MiB", "memcpy var", "==per-group")
#: The request whose state moves with the chunk, among this many state slots.
STATE_SLOT, STATE_SLOTS = 1, 2


@dataclass(frozen=True)
class ModelRow(Timed):
    model: str
    obj: str
    tokens: int
    dir: str
    bytes: int
    seconds: Mapping[str, Sequence[float]]
    #: Extra resident bytes at the peak of one call (CPU only).
    peak_bytes: int | None
    matches: bool

    @property
    def x_per_group(self) -> Spread:
        return paired_ratios(self.seconds["per-group"], self.seconds["kvgen"])

    def cells(self) -> tuple[str, ...]:
        var = f"{self.memcpy_variation * 100:.0f}%" + (" !" if self.memcpy_unstable else "  ")
        peak = "-" if self.peak_bytes is None else f"{self.peak_bytes / 2**20:.1f}"
        return (self.model, self.obj, str(self.tokens), self.dir, f"{self.gbps():.2f}", f"{self.gbps('memcpy'):.2f}",
                self.x_memcpy.cell(), f"{self.gbps('per-group'):.2f}", self.x_per_group.cell(), peak, var,
                "yes" if self.matches else "NO")

    def as_dict(self) -> dict[str, object]:
        return {"model": self.model, "object": self.obj, "tokens": self.tokens, "dir": self.dir, "bytes": self.bytes,
                "gbps": self.gbps(), "memcpy_gbps": self.gbps("memcpy"), "per_group_gbps": self.gbps("per-group"),
                "x_memcpy": vars(self.x_memcpy), "x_per_group": vars(self.x_per_group),
                "peak_bytes": self.peak_bytes, "memcpy_variation": self.memcpy_variation, "matches": self.matches,
                "repeat_seconds": {k: list(v) for k, v in self.seconds.items()}}


def select(text: str, library: Any) -> list[Any]:
    """The model specs `text` names (comma-separated; `none` or nothing: no model rows)."""
    if text.strip().lower() in ("", "none"):
        return []
    return [library.model(name.strip()) for name in text.split(",") if name.strip()]


class _Chunk:
    """One chunk [0, T) of one model: its cache list, slot mappings and two objects."""

    def __init__(self, ctx: BenchContext, model: Any, obj: Any, tokens: int):
        package, device, block_size = ctx.package, ctx.device, ctx.args.block_size
        self.conn = package.get_model(model.name, obj.name)(device=device)
        blocks = -(-tokens * 5 // (4 * block_size))
        sizes = oracle.CaseSizes(blocks=blocks, block_size=block_size)
        self.case = oracle.model_case(ctx.library, model, obj, set(package.CONNECTORS), sizes)
        # a group whose layout fixes a smaller block needs more of them for the chunk
        need = max((-(-tokens // g.tokens_per_slot * 5 // (4 * g.ext["N"])) for g in self.case.groups), default=0)
        if need > blocks:
            self.case = oracle.model_case(ctx.library, model, obj, set(package.CONNECTORS),
                                          dataclasses.replace(sizes, blocks=need))
        self.cache = make_kvcaches(self.case, str(device), dtype=ctx.args.dtype, slots=STATE_SLOTS)
        # a group of k tokens per slot names one slot per k tokens
        self.slots = {g.name: tokens // g.tokens_per_slot for g in self.case.groups}
        self.maps = {g.name: torch.tensor(slot_mapping(self.slots[g.name], g.ext["B"], g.ext["N"], "random", ctx.rng),
                                          device=device) for g in self.case.groups}
        self.T = tokens
        shape = self.conn.get_shape(tokens, self.cache)
        self.obj = MemoryObj(torch.zeros(shape, dtype=torch.uint8, device=device))
        self.twin = torch.zeros(shape, dtype=torch.uint8, device=device)
        self.members = {g.name: package.get(g.paged.name, g.member.name)(device=device) for g in self.case.groups}
        self.state_rows = self._state_rows()

    def _state_rows(self) -> list[tuple[torch.Tensor, slice]]:
        """(state tensor, its section's byte range) for every carried state tensor."""
        sections = {s.name: s for s in self.conn.sections(self.T, self.cache)}
        out = []
        for s in self.case.states:
            for layer in s.layers:
                for j, (name, _) in enumerate(s.tensors):
                    sec = sections[f"{s.name}[{layer}].{name}"]
                    out.append((self.cache[layer][j], slice(sec.offset, sec.offset + sec.nbytes)))
        return out

    def store(self) -> None:
        self.conn.from_gpu(self.obj, 0, self.T, kvcaches=self.cache, slot_mappings=self.maps,
                           state_slot=STATE_SLOT if self.case.states else None)

    def load(self, cache: Any = None) -> None:
        self.conn.to_gpu(self.obj, 0, self.T, kvcaches=cache or self.cache, slot_mappings=self.maps,
                         state_slot=STATE_SLOT if self.case.states else None)

    def per_group_store(self, into: torch.Tensor | None = None) -> None:
        into = self.twin if into is None else into
        for g in self.case.groups:
            view = self.conn.member_view(into, g.name, self.T, self.cache)
            self.members[g.name].from_gpu(MemoryObj(view), 0, self.slots[g.name],
                                          kvcaches=[self.cache[i] for i in g.layers], slot_mapping=self.maps[g.name])
        for t, where in self.state_rows:
            into[where].copy_(t[STATE_SLOT].reshape(-1).view(torch.uint8))

    def per_group_load(self, cache: Any = None) -> None:
        cache = cache or self.cache
        for g in self.case.groups:
            view = self.conn.member_view(self.obj.tensor, g.name, self.T, self.cache)
            member = self.members[g.name]
            member.to_gpu(MemoryObj(view, member.format), 0, self.slots[g.name], kvcaches=[cache[i] for i in g.layers],
                          slot_mapping=self.maps[g.name])
        rows = iter(self.state_rows)
        for s in self.case.states:
            for layer in s.layers:
                for j in range(len(s.tensors)):
                    t, where = next(rows)
                    cache[layer][j][STATE_SLOT].reshape(-1).view(torch.uint8).copy_(self.obj.tensor[where])


def rows(selected: Sequence[Any], ctx: BenchContext) -> list[ModelRow]:
    """Store and load rows of every selected model's kv_groups connector at every token count."""
    out: list[ModelRow] = []
    obj = ctx.library["kv_groups"]
    for model in selected:
        for tokens in ctx.args.tokens:
            ck = _Chunk(ctx, model, obj, tokens)
            nbytes = ck.obj.tensor.numel()
            copy = memcpy(nbytes, ctx.device)
            ck.store()
            ck.per_group_store()
            stored = same_bits(ck.obj.tensor, ck.twin)
            fresh, twin = clone_tree(ck.cache), clone_tree(ck.cache)
            ck.load(fresh)
            ck.per_group_load(twin)
            loaded = same_bits(fresh, twin)
            for direction, fns, same in (
                    ("store", {"kvgen": ck.store, "memcpy": copy, "per-group": ck.per_group_store}, stored),
                    ("load", {"kvgen": ck.load, "memcpy": copy, "per-group": ck.per_group_load}, loaded)):
                seconds = timed_repeats(fns, ctx.sync, ctx.args.warmup, ctx.args.repeats)
                peak = peak_extra_bytes(fns["kvgen"]) if ctx.device.type == "cpu" else None
                out.append(ModelRow(model.name, obj.name, tokens, direction, nbytes, seconds, peak, same))
                if ctx.progress:
                    r = out[-1]
                    print(f"[model {len(out)}] {r.model} T={tokens} {direction}: {r.gbps():.2f} GB/s (memcpy "
                          f"{r.gbps('memcpy'):.2f}, per-group {r.gbps('per-group'):.2f}, same bits "
                          f"{'yes' if same else 'NO'})", file=sys.stderr, flush=True)
    return out


def text(found: Sequence[ModelRow]) -> list[str]:
    lines = ["", "Model connectors (kv_groups: every group with its own block table, one request's state): the "
             "model connector, a plain copy of the same bytes, and the per-group path (each group's own "
             "connector into its section, state rows copied by hand)",
             table(HEADERS, [r.cells() for r in found]),
             "x memcpy = memcpy seconds / model connector seconds, x per-group = per-group seconds / model connector "
             "seconds, each of the same repeat"]
    bad = sum(1 for r in found if not r.matches)
    lines.append(f"model connector and per-group path DISAGREED on {bad} of {len(found)} rows" if bad else
                 f"model connector and per-group path agreed bit for bit on all {len(found)} rows")
    return lines
