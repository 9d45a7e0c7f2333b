"""Scenarios for model connectors, shared by the tests and `kvgen verify`: a model's cache list
with every element coded by its group, layer and position, state tensors coded the same way,
per-group slot mappings, and one transfer run through a connector and through the reference
(kvgen.oracle.models), compared bit for bit both ways.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvgen.oracle import models, planes, reference
from kvgen.oracle.scenarios import block_table_mapping, clone_tree, same_bits
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
    space, n = reference.code_space(t.dtype) - 1, t.numel()
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
        codes = torch.arange(base, base + words, dtype=torch.int64).to(torch.int32)
        raw[:4 * words].view(torch.int32).copy_(codes.to(raw.device))
    if tail:
        raw[4 * words:].copy_(torch.arange(tail, dtype=torch.uint8) + base % 200)


def pick_dtype(allowed: Sequence[str], prefer: str = "float32") -> torch.dtype:
    return getattr(torch, prefer if prefer in allowed else allowed[0])


def make_kvcaches(case: models.ModelCase, device: str = "cpu", *, dtype: str = "float32",
                  slots: int = STATE_SLOTS) -> list[Any]:
    """The model's cache list: each carried group's entries from a cache of its layout, each
    carried state layer a tuple of [slots, *shape] tensors; every value coded by place."""
    entries: list[Any] = [None] * case.model.layers
    base = 1
    for g in case.groups:
        group = next(x for x in case.model.groups if x.name == g.name)
        want = pick_dtype(group.dtypes or g.paged.dtypes, dtype)
        if g.paged.is_simple:
            shape = reference.leaf_shape(g.paged, g.ext)
            cache = reference.nest(g.paged, g.ext,
                                   lambda path, shape=shape, want=want: torch.zeros(shape, dtype=want,
                                                                                    device=device))
            for t in leaves(cache):
                fill_codes(t, base)
                base += t.numel() + 7919
        else:
            cache = planes.make_parts_cache(g.paged, g.ext, want, device)
            for t in leaves(cache):
                fill_words(t, base)
                base += t.numel() + 7919
        for k, layer in enumerate(g.layers):
            entries[layer] = cache[k]
    for s in case.states:
        state = next(x for x in case.model.states if x.name == s.name)
        for layer in s.layers:
            tensors = []
            for (_, shape), spec in zip(s.tensors, state.tensors, strict=True):
                t = torch.empty((slots, *shape), dtype=pick_dtype(spec.dtypes, dtype), device=device)
                fill_codes(t, base)
                base += t.numel() + 7919
                tensors.append(t)
            entries[layer] = tuple(tensors)
    for i, e in enumerate(entries):  # entries of groups the object does not carry: left empty
        if e is None:
            entries[i] = torch.zeros(0, device=device)
    return entries


def make_objects(connector: Any, lengths: Sequence[int], kvcaches: Any, salt: str, device: str = "cpu",
                 fmt: Any = None) -> list[MemoryObj]:
    out = []
    for k, n in enumerate(lengths):
        t = torch.zeros(connector.get_shape(n, kvcaches), dtype=torch.uint8, device=device)
        fill_words(t, 1_000_000_000 + 10_000_000 * k + sum(map(ord, salt)))
        out.append(MemoryObj(t, fmt))
    return out


def group_mappings(case: models.ModelCase, sc: ModelScenario, seed: str) -> dict[str, list[int]]:
    rng = random.Random(seed)
    length = sc.seq_len - sc.offset
    return {g.name: sc.mapping(rng, i, dict(g.ext), length) for i, g in enumerate(case.groups)}


def state_slots(sc: ModelScenario, chunks: int, slot: int) -> list[int | None] | None:
    if sc.state_chunk is None:
        return None
    at = sc.state_chunk % chunks
    return [slot if k == at else None for k in range(chunks)]


def check_model(package: Any, library: Library, model: ModelSpec, obj: Spec, sc: ModelScenario, *,
                device: str = "cpu", tp: int = 1, connector: Any = None, slot: int = 1,
                block_size: int | None = None, blocks: int = 8, requests: int = STATE_SLOTS) -> tuple[bool, bool]:
    """(store ok, load ok) of a model connector against the reference for one scenario."""
    available: Collection[tuple[str, str]] = set(package.CONNECTORS)
    case = models.model_case(library, model, obj, available, tp=tp, blocks=blocks, block_size=block_size)
    # A group with small blocks needs more of them to hold the scenario's sequence.
    need = max((-(-sc.seq_len // g.ext["N"]) for g in case.groups), default=0)
    if need > blocks:
        case = models.model_case(library, model, obj, available, tp=tp, blocks=need, block_size=block_size)
    if connector is None:
        connector = package.get_model(model.name, obj.name)(device=device, tp=tp)
    kvcaches = make_kvcaches(case, device, slots=requests)
    maps = group_mappings(case, sc, f"{model.name}/{obj.name}/{sc.name}")
    tensors = {g: torch.tensor(m, dtype=torch.long, device=device) for g, m in maps.items()}
    lengths = [e - s for s, e in zip(sc.starts, sc.ends, strict=True)]
    slots = state_slots(sc, len(lengths), slot) if case.states else None
    objs = make_objects(connector, lengths, kvcaches, "7", device)
    want = make_objects(connector, lengths, kvcaches, "7", device)
    connector.batched_from_gpu(objs, list(sc.starts), list(sc.ends), kvcaches=kvcaches, slot_mappings=tensors,
                               state_slots=slots, offset=sc.offset)
    for k, (o, s, e) in enumerate(zip(want, sc.starts, sc.ends, strict=True)):
        models.store(case, kvcaches, o.tensor, maps, s, e, sc.offset, slots[k] if slots else None)
    store_ok = same_bits([o.tensor for o in objs], [o.tensor for o in want])
    # Load into a cache whose every value differs, so a missed or misplaced write shows.
    fresh = make_kvcaches(case, device, slots=requests)
    for t in leaves(fresh):
        if t.numel():
            bits(t).view(torch.uint8 if t.element_size() == 1 else bits(t).dtype).bitwise_not_()
    expected = clone_tree(fresh)
    connector.batched_to_gpu(objs, list(sc.starts), list(sc.ends), kvcaches=fresh, slot_mappings=tensors,
                             state_slots=slots, offset=sc.offset, skip_prefix_n_tokens=sc.skip)
    for k, (o, s, e) in enumerate(zip(objs, sc.starts, sc.ends, strict=True)):
        models.load(case, expected, o.tensor, maps, s, e, sc.offset, sc.skip, slots[k] if slots else None)
    return store_ok, same_bits(fresh, expected)
