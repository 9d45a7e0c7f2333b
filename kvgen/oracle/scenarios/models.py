"""Scenarios for model connectors, shared by the tests and `kvgen verify`: a model's cache list
with every element coded by its group, layer and position, state tensors coded the same way,
per-group slot mappings, and one transfer run through a connector and through the reference
(kvgen.oracle.reference.models), compared bit for bit both ways.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvgen.oracle import reference
from kvgen.oracle.reference import models, planes
from kvgen.oracle.scenarios.common import block_table_mapping, clone_tree, same_bits
from kvgen.runtime import MemoryObj
from kvgen.runtime.binding import leaves
from kvgen.runtime.ops import bits
from kvgen.spec.library import Library
from kvgen.spec.model import Spec
from kvgen.spec.models import ModelSpec

#: Request slots of the test state tensors.
STATE_SLOTS = 3

#: A group's slot mapping for a scenario: (rng, group index, extents, tokens) -> slots.
GroupMapping = Callable[[random.Random, int, dict[str, int], int], list[int]]


def _blocks(rng: random.Random, i: int, ext: dict[str, int], n: int) -> list[int]:
    return block_table_mapping(n, rng, ext)


def _holes(rng: random.Random, i: int, ext: dict[str, int], n: int) -> list[int]:
    """Each group skips other tokens (-1 at different places per group)."""
    out = block_table_mapping(n, rng, ext)
    for t in range(i % 3, n, 3 + i):
        out[t] = -1
    return out


def _first_group_idle(rng: random.Random, i: int, ext: dict[str, int], n: int) -> list[int]:
    """Group 0 moves nothing (a sliding window past it); the others move every token."""
    return [-1] * n if i == 0 else block_table_mapping(n, rng, ext)


def _window(rng: random.Random, i: int, ext: dict[str, int], n: int) -> list[int]:
    """Group 0 keeps only the last 5 tokens (a sliding window), the others all of them."""
    out = block_table_mapping(n, rng, ext)
    return [-1] * (n - 5) + out[n - 5:] if i == 0 else out


@dataclass(frozen=True)
class ModelScenario:
    name: str
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    mapping: GroupMapping
    offset: int = 0
    skip: int = 0
    #: Chunk index whose object carries the state (the last chunk of the stored prefix), or None.
    state_chunk: int | None = -1

    @property
    def seq_len(self) -> int:
        return max(self.ends)


SCENARIOS = {s.name: s for s in (
    ModelScenario("whole_blocks", (0,), (16,), _blocks),
    ModelScenario("partial_blocks", (2,), (15,), _blocks),
    ModelScenario("minus1_per_group", (0,), (14,), _holes),
    ModelScenario("one_group_all_minus1", (0,), (12,), _first_group_idle),
    ModelScenario("sliding_window_chunks", (0, 6, 13), (6, 13, 19), _window),
    ModelScenario("offset_skip", (4, 12), (12, 19), _holes, offset=3, skip=2),
    ModelScenario("no_state", (0,), (9,), _blocks, state_chunk=None),
)}


def fill_codes(t: torch.Tensor, base: int) -> None:
    """Every element gets a finite code of `base` plus its position (float caches stay finite)."""
    raw = bits(t)
    if not t.dtype.is_floating_point or t.element_size() == 1:
        fill_words(t, base)
        return
    space, n = reference.layouts.code_space(t.dtype) - 1, t.numel()
    if base + n <= space and raw.dtype == torch.int32:  # the common case, without int64 arithmetic
        codes = torch.arange(base + 1, base + n + 1, dtype=torch.int32)
    else:
        codes = ((torch.arange(n, dtype=torch.int64) + base) % space + 1).to(raw.dtype)
    raw.view(-1).copy_(codes) if raw.is_contiguous() else raw.copy_(codes.view(raw.shape))


def fill_words(t: torch.Tensor, base: int) -> None:
    """Every 4 bytes of `t` (contiguous) get the code `base` + their position, so a misplaced
    run of bytes differs from the one expected; any tail byte the code of its position."""
    raw = t.view(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    words, tail = divmod(raw.numel(), 4)
    if words:
        if base + words <= 2**31:  # the common case, without an int64 range twice the tensor's size
            codes = torch.arange(base, base + words, dtype=torch.int32)
        else:  # int64 codes wrapped to their low 32 bits
            codes = torch.arange(base, base + words, dtype=torch.int64).to(torch.int32)
        raw[:4 * words].view(torch.int32).copy_(codes.to(raw.device))
    if tail:
        raw[4 * words:].copy_(torch.arange(tail, dtype=torch.uint8) + base % 200)


def pick_dtype(allowed: Sequence[str], prefer: str = "float32") -> torch.dtype:
    return getattr(torch, prefer if prefer in allowed else allowed[0])


class _Codes:
    """Where the next tensor's codes start: past the last tensor's, plus a prime gap."""

    def __init__(self) -> None:
        self.base = 1

    def fill(self, t: torch.Tensor, words: bool = False) -> None:
        (fill_words if words else fill_codes)(t, self.base)
        self.base += t.numel() + 7919


def _group_cache(g: models.GroupCase, want: torch.dtype, device: str, codes: _Codes) -> Any:
    """A cache of the group's layout (L = its layer count), every value coded by place."""
    if g.paged.is_simple:
        shape = reference.layouts.leaf_shape(g.paged, g.ext)
        cache = reference.layouts.nest(g.paged, g.ext, lambda path: torch.zeros(shape, dtype=want, device=device))
    else:
        cache = planes.make_parts_cache(g.paged, g.ext, want, device)
    for t in leaves(cache):
        codes.fill(t, words=not g.paged.is_simple)
    return cache


def make_kvcaches(case: models.ModelCase, device: str = "cpu", *, dtype: str = "float32",
                  slots: int = STATE_SLOTS) -> list[Any]:
    """The model's cache list: each carried group's entries from a cache of its layout, each
    carried state layer a tuple of [slots, *shape] tensors; every value coded by place."""
    entries: list[Any] = [None] * case.model.layers
    codes = _Codes()
    for g in case.groups:
        group = next(x for x in case.model.groups if x.name == g.name)
        cache = _group_cache(g, pick_dtype(group.dtypes or g.paged.dtypes, dtype), device, codes)
        for k, layer in enumerate(g.layers):
            entries[layer] = cache[k]
    for s in case.states:
        state = next(x for x in case.model.states if x.name == s.name)
        for layer in s.layers:
            tensors = []
            for (_, shape), spec in zip(s.tensors, state.tensors, strict=True):
                t = torch.empty((slots, *shape), dtype=pick_dtype(spec.dtypes, dtype), device=device)
                codes.fill(t)
                tensors.append(t)
            entries[layer] = tuple(tensors)
    # entries of groups the object does not carry: left empty
    return [torch.zeros(0, device=device) if e is None else e for e in entries]


def make_objects(connector: Any, lengths: Sequence[int], kvcaches: Any, salt: str, device: str = "cpu",
                 fmt: Any = None) -> list[MemoryObj]:
    out = []
    for k, n in enumerate(lengths):
        t = torch.zeros(connector.get_shape(n, kvcaches), dtype=torch.uint8, device=device)
        fill_words(t, 1_000_000_000 + 10_000_000 * k + sum(map(ord, salt)))
        out.append(MemoryObj(t, fmt))
    return out


def group_mappings(case: models.ModelCase, sc: ModelScenario, seed: str) -> dict[str, list[int]]:
    """Each group's slot mapping: one slot per token from the offset on, per k tokens for a group
    of k tokens per slot."""
    rng = random.Random(seed)
    length = sc.seq_len - sc.offset
    return {g.name: sc.mapping(rng, i, dict(g.ext), length // g.tokens_per_slot) for i, g in enumerate(case.groups)}


def in_whole_slots(model: ModelSpec, sc: ModelScenario) -> ModelScenario:
    """The scenario in units of the model's widest slot: every position times the least common
    multiple of its groups' tokens_per_slot, so each chunk starts and ends on whole slots."""
    k = math.lcm(*(g.tokens_per_slot for g in model.groups)) if model.groups else 1
    if k == 1:
        return sc
    return replace(sc, starts=tuple(s * k for s in sc.starts), ends=tuple(e * k for e in sc.ends),
                   offset=sc.offset * k, skip=sc.skip * k)


def state_slots(sc: ModelScenario, chunks: int, slot: int) -> list[int | None] | None:
    if sc.state_chunk is None:
        return None
    at = sc.state_chunk % chunks
    return [slot if k == at else None for k in range(chunks)]


@dataclass(frozen=True)
class ModelRun:
    """How check_model runs a scenario: the device, the tensor-parallel size, a connector to
    reuse (None: a fresh one), the request's state slot, the cache's block size and count
    (more blocks where the scenario's sequence needs them) and the requests a state holds."""

    device: str = "cpu"
    tp: int = 1
    connector: Any = None
    slot: int = 1
    block_size: int | None = None
    blocks: int = 8
    requests: int = STATE_SLOTS


def _scrambled(fresh: Any) -> Any:
    """`fresh` (a copy of make_kvcaches' cache, which is the same on every call for a case) with
    every value changed in place, so a missed or misplaced write shows."""
    for t in leaves(fresh):
        if t.numel():
            bits(t).view(torch.uint8 if t.element_size() == 1 else bits(t).dtype).bitwise_not_()
    return fresh


def _chunks(sc: ModelScenario, maps: dict[str, list[int]], slots: list[int | None] | None) -> list[models.ModelChunk]:
    return [models.ModelChunk(maps, s, e, sc.offset, sc.skip, slots[k] if slots else None)
            for k, (s, e) in enumerate(zip(sc.starts, sc.ends, strict=True))]


def check_model(package: Any, library: Library, model: ModelSpec, obj: Spec, sc: ModelScenario,
                run: ModelRun = ModelRun()) -> tuple[bool, bool]:
    """(store ok, load ok) of a model connector against the reference for one scenario."""
    available: Collection[tuple[str, str]] = set(package.CONNECTORS)
    sizes = models.CaseSizes(run.tp, run.blocks, run.block_size)
    sc = in_whole_slots(model, sc)
    case = models.model_case(library, model, obj, available, sizes)
    # A group with small blocks needs more of them to hold the scenario's sequence.
    need = max((-(-sc.seq_len // g.tokens_per_slot // g.ext["N"]) for g in case.groups), default=0)
    if need > run.blocks:
        case = models.model_case(library, model, obj, available, replace(sizes, blocks=need))
    connector = run.connector or package.get_model(model.name, obj.name)(device=run.device, tp=run.tp)
    kvcaches = make_kvcaches(case, run.device, slots=run.requests)
    # Copied before the connector runs (a copy is cheaper than coding the cache again).
    pristine = clone_tree(kvcaches)
    maps = group_mappings(case, sc, f"{model.name}/{obj.name}/{sc.name}")
    tensors = {g: torch.tensor(m, dtype=torch.long, device=run.device) for g, m in maps.items()}
    lengths = [e - s for s, e in zip(sc.starts, sc.ends, strict=True)]
    slots = state_slots(sc, len(lengths), run.slot) if case.states else None
    objs = make_objects(connector, lengths, kvcaches, "7", run.device)
    want = make_objects(connector, lengths, kvcaches, "7", run.device)
    connector.batched_from_gpu(objs, list(sc.starts), list(sc.ends), kvcaches=kvcaches, slot_mappings=tensors,
                               state_slots=slots, offset=sc.offset)
    for o, chunk in zip(want, _chunks(sc, maps, slots), strict=True):
        models.store(case, kvcaches, o.tensor, chunk)
    store_ok = same_bits([o.tensor for o in objs], [o.tensor for o in want])
    fresh = _scrambled(pristine)
    expected = clone_tree(fresh)
    connector.batched_to_gpu(objs, list(sc.starts), list(sc.ends), kvcaches=fresh, slot_mappings=tensors,
                             state_slots=slots, offset=sc.offset, skip_prefix_n_tokens=sc.skip)
    for o, chunk in zip(objs, _chunks(sc, maps, slots), strict=True):
        models.load(case, expected, o.tensor, chunk)
    return store_ok, same_bits(fresh, expected)
