"""The scenarios of connectors of a (layout, object) pair, shared by the test suite and `kvgen
verify`, for both kinds of pair (caches of one tensor tree; caches of several parts or fields,
coded byte by byte by kvgen.oracle.reference.planes): small coordinate-coded caches and objects,
slot-mapping scenarios, and one transfer run through a connector and through the reference.
Cache elements carry the code of their coordinates (layer, kv, slot, head, c), objects codes of
their own positions; comparisons are bitwise.

The -1 scenarios put skipped tokens at every place relative to whole blocks (before, inside,
between, after, at both chunk ends, everywhere), because a connector moves whole in-order
blocks on a fast path and the tokens around them one by one: a -1 must never be taken into
the block path or shift the tokens after it. The storage scenarios hand over caches and
objects whose strides or storage offsets forbid wide copy words.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

import torch

from kvgen.oracle import reference
from kvgen.oracle.reference import planes
from kvgen.oracle.scenarios.common import allocate, block_table_mapping, clone_tree, same_bits, tensors_of
from kvgen.runtime import MemoryObj
from kvgen.runtime.ops import bits
from kvgen.spec.elements import place_of, split_of
from kvgen.spec.model import Spec

#: Small geometry: 3 layers, 2 heads, 4 values per head, 12 blocks of 4 slots.
EXT = {"L": 3, "KV": 2, "H": 2, "C": 4, "N": 4, "B": 12}


def whole_blocks(rng: random.Random, ext: dict[str, int], count: int) -> list[list[int]]:
    """`count` distinct blocks in random order, each as its N slots in order."""
    n = ext["N"]
    return [[b * n + i for i in range(n)] for b in rng.sample(range(ext["B"]), count)]


@dataclass(frozen=True)
class Scenario:
    name: str
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    mapping: Callable[[random.Random, dict[str, int]], list[int]]
    #: Cache leaves are permuted views into a larger buffer (last dim not contiguous).
    strided: bool = False
    offset: int = 0
    #: Cache leaves / memory objects start one element into their storage.
    odd_cache: bool = False
    odd_objects: bool = False
    #: The prefix of each chunk a load leaves alone (skip_prefix_n_tokens).
    skip: int = 0
    #: The cache's extents (EXT; Triton's interpreter pass of verify takes fewer layers).
    ext: Mapping[str, int] = field(default_factory=lambda: EXT)

    @property
    def seq_len(self) -> int:
        return max(self.ends)


def _random_slots(rng: random.Random, ext: dict[str, int]) -> list[int]:
    return rng.sample(range(ext["B"] * ext["N"]), 20)


def _prefix_hit(rng: random.Random, ext: dict[str, int]) -> list[int]:
    return [-1] * 6 + block_table_mapping(16, rng, ext)[6:]


def _minus1_before(rng: random.Random, ext: dict[str, int]) -> list[int]:
    a, b, c = whole_blocks(rng, ext, 3)
    return [-1] * 3 + a + b + c


def _minus1_inside(rng: random.Random, ext: dict[str, int]) -> list[int]:
    a, b, c, d = whole_blocks(rng, ext, 4)
    return a + [b[0], -1, *b[2:]] + c + d


def _minus1_between(rng: random.Random, ext: dict[str, int]) -> list[int]:
    a, b, c = whole_blocks(rng, ext, 3)
    return a + [-1] + b + [-1, -1] + c


def _minus1_after(rng: random.Random, ext: dict[str, int]) -> list[int]:
    """Two whole blocks, then a block whose third token is skipped: `[8,9,10,11, 20,21,22,23,
    28,29,-1,31]` at N=4. A connector that took the -1 into its whole-block planning would
    write the cache's last slot for it and drop the token after it."""
    n = ext["N"]
    last = list(range(7 * n, 8 * n))
    last[2] = -1
    return list(range(2 * n, 3 * n)) + list(range(5 * n, 6 * n)) + last


def _minus1_after_consecutive(rng: random.Random, ext: dict[str, int]) -> list[int]:
    """As above with consecutive blocks, which move as one slice."""
    n = ext["N"]
    return list(range(3 * n, 5 * n)) + [-1] + list(range(5 * n + 1, 6 * n))


def _minus1_chunk_ends(rng: random.Random, ext: dict[str, int]) -> list[int]:
    """Chunks [0, 10), [10, 13), [13, 24): -1 first and last in each, the middle one all -1,
    partial blocks next to the -1s of the last."""
    a, b, c, d, e = whole_blocks(rng, ext, 5)
    return [-1] + a + b + [-1] + [-1] * 3 + [-1, -1] + c[2:] + d + e[:1] + [-1, -1]


SCENARIOS = {
    s.name: s for s in (
        Scenario("random_slots", (0,), (20,), _random_slots),
        Scenario("whole_blocks", (0,), (16,), lambda r, e: block_table_mapping(16, r, e)),
        Scenario("partial_blocks", (2,), (15,), lambda r, e: block_table_mapping(15, r, e)),
        Scenario("minus1_prefix", (0,), (16,), _prefix_hit),
        Scenario("noncontiguous_chunks", (0, 7, 19), (4, 13, 25), lambda r, e: block_table_mapping(25, r, e)),
        Scenario("consecutive_blocks", (0,), (16,), lambda r, e: [e["N"] * 3 + i for i in range(16)]),
        Scenario("strided_cache", (0,), (16,), lambda r, e: block_table_mapping(16, r, e), strided=True),
        Scenario("minus1_before_blocks", (0,), (15,), _minus1_before),
        Scenario("minus1_inside_block", (0,), (16,), _minus1_inside),
        Scenario("minus1_between_blocks", (0,), (15,), _minus1_between),
        Scenario("minus1_after_blocks", (0,), (12,), _minus1_after),
        Scenario("minus1_after_consecutive_blocks", (0,), (12,), _minus1_after_consecutive),
        Scenario("minus1_chunk_ends", (0, 10, 13), (10, 13, 24), _minus1_chunk_ends),
        Scenario("minus1_all", (0, 5), (5, 12), lambda r, e: [-1] * 12),
        Scenario("odd_offset_cache", (0,), (15,), _minus1_between, odd_cache=True),
        Scenario("odd_offset_objects", (0,), (15,), _minus1_between, odd_objects=True),
    )
}


@cache
def _filled(paged: Spec, dtype: torch.dtype, extents: tuple[tuple[str, int], ...]) -> Any:
    """The coded cache of a layout at `extents` (sorted items), computed once (the reference
    fills it element by element); make_cache copies it into freshly allocated leaves. Never
    written to."""
    ext = dict(extents)
    if not paged.is_simple:  # format 2: every byte carries a code of its part, leaf and place
        return planes.make_parts_cache(paged, planes.parts_extents(paged, ext), dtype, "cpu")
    shape = reference.layouts.leaf_shape(paged, ext)
    cache = reference.layouts.nest(paged, ext, lambda path: torch.zeros(shape, dtype=dtype))
    reference.layouts.fill_cache(paged, ext, cache, dtype)
    return cache


def make_cache(paged: Spec, dtype: torch.dtype, device: str, strided: bool = False,
               odd_offset: bool = False, *, ext: Mapping[str, int] = EXT) -> Any:
    template = _filled(paged, dtype, tuple(sorted(ext.items())))
    if not paged.is_simple:
        return planes.copy_parts_cache(paged, planes.parts_extents(paged, ext), template, device, strided,
                                       odd_offset)
    shape = reference.layouts.leaf_shape(paged, ext)

    def leaf(path: tuple[int, ...]) -> torch.Tensor:
        t = allocate(shape, dtype, device, strided, odd_offset)
        bits(t).copy_(bits(reference.leaf(template, path)))
        return t

    return reference.layouts.nest(paged, ext, leaf)


def make_objects(connector: Any, lengths: Sequence[int], dtype: torch.dtype, device: str, salt: int,
                 fmt: Any = None) -> list[Any]:
    """Objects per chunk in the connector's form, filled with codes distinct from the cache's:
    one tensor per chunk, or (a layerwise connector) a list of per-layer tensors per chunk
    (at_odd_offsets moves them one element into their storage)."""
    layerwise = connector.layerwise
    out = []
    packed = getattr(connector.memory, "pack", None) is not None
    if packed:  # format-2 objects: their own dtype (bytes for regions), every byte coded
        dtype = connector.get_dtype()

    def fill(tensors: list[torch.Tensor], salt: int) -> None:
        if not packed:
            reference.layouts.fill_object(tensors, dtype, salt)
            return
        for j, t in enumerate(tensors):
            planes.fill_bytes(t, f"object/{salt}/{j}")

    for i, n in enumerate(lengths):
        shape = connector.get_shape(n)
        if layerwise:
            layers = [allocate(shape, dtype, device, False) for _ in range(connector.geometry.L)]
            fill(layers, salt + 100000 * i)
            out.append([MemoryObj(t, fmt) for t in layers])
        else:
            t = allocate(shape, dtype, device, False)
            fill([t], salt + 100000 * i)
            out.append(MemoryObj(t, fmt))
    return out


def at_odd_offsets(objs: list[Any]) -> list[Any]:
    """The objects of make_objects, each tensor copied to one element into a storage of its own
    (same bits, same format label): what a caller's misaligned buffer looks like."""

    def moved(o: MemoryObj) -> MemoryObj:
        t = allocate(tuple(o.tensor.shape), o.tensor.dtype, str(o.tensor.device), False, odd_offset=True)
        bits(t).copy_(bits(o.tensor))
        return MemoryObj(t, o.metadata.fmt)

    return [[moved(o) for o in c] if isinstance(c, list) else moved(c) for c in objs]


def obj_tensors(obj: Any) -> Any:
    return [o.tensor for o in obj] if isinstance(obj, list) else obj.tensor


def connector_store(connector: Any, objs: list[Any], sc: Scenario, cache: Any, mapping: torch.Tensor,
                    *, sync: bool = True) -> int:
    """Store through the connector; returns the number of generator yields (0 when whole)."""
    if not connector.layerwise:
        connector.batched_from_gpu(objs, sc.starts, sc.ends, kvcaches=cache, slot_mapping=mapping,
                                   offset=sc.offset)
        return 0
    per_layer = [[chunk[layer] for chunk in objs] for layer in range(connector.geometry.L)]
    gen = connector.batched_from_gpu(per_layer, sc.starts, sc.ends, kvcaches=cache, slot_mapping=mapping,
                                     sync=sync, offset=sc.offset)
    return sum(1 for _ in gen)


def connector_load(connector: Any, objs: list[Any], sc: Scenario, cache: Any, mapping: torch.Tensor) -> int:
    """Load through the connector, leaving each chunk's first sc.skip tokens alone; the number of
    generator steps (0 when whole)."""
    if not connector.layerwise:
        connector.batched_to_gpu(objs, sc.starts, sc.ends, kvcaches=cache, slot_mapping=mapping,
                                 offset=sc.offset, skip_prefix_n_tokens=sc.skip)
        return 0
    gen = connector.batched_to_gpu(sc.starts, sc.ends, kvcaches=cache, slot_mapping=mapping,
                                   offset=sc.offset, skip_prefix_n_tokens=sc.skip)
    yields = 1
    next(gen)
    for layer in range(connector.geometry.L):
        gen.send([chunk[layer] for chunk in objs])
        yields += 1
    next(gen)
    return yields + 1


def _reference_extents(paged: Spec, ext: Mapping[str, int]) -> Mapping[str, int]:
    """The extents the reference of the pair's kind takes: a format-2 cache's parts each get a width."""
    return ext if paged.is_simple else planes.parts_extents(paged, ext)


def reference_store(paged: Spec, obj: Spec, cache: Any, objs: list[Any], sc: Scenario,
                    mapping: Sequence[int]) -> None:
    ext = _reference_extents(paged, sc.ext)
    for o, s, e in zip(objs, sc.starts, sc.ends, strict=False):
        reference.store(paged, obj, ext, cache, obj_tensors(o), reference.Span(mapping, s, e, sc.offset))


def reference_load(paged: Spec, obj: Spec, cache: Any, objs: list[Any], sc: Scenario,
                   mapping: Sequence[int]) -> None:
    ext = _reference_extents(paged, sc.ext)
    for o, s, e in zip(objs, sc.starts, sc.ends, strict=False):
        reference.load(paged, obj, ext, cache, obj_tensors(o), reference.Span(mapping, s, e, sc.offset, sc.skip))


def _pair_inputs(connector: Any, paged: Spec, obj: Spec, scenario: Scenario, dtype: torch.dtype
                 ) -> tuple[list[int], torch.Tensor, list[int], Any, list[Any]]:
    """(slots as a list, slots, chunk lengths, the coded cache bound to `connector`, the objects
    to store into) of one scenario of check_pair."""
    device = str(connector.device)
    rng = random.Random(f"{paged.name}/{obj.name}/{scenario.name}")
    mapping_list = scenario.mapping(rng, manager_extents(paged, scenario.ext))
    mapping = torch.tensor(mapping_list, dtype=torch.long, device=device)
    lengths = [e - s for s, e in zip(scenario.starts, scenario.ends, strict=False)]
    cache = make_cache(paged, dtype, device, scenario.strided, scenario.odd_cache, ext=scenario.ext)
    connector.bind(cache)
    objs = make_objects(connector, lengths, dtype, device, salt=7)
    return mapping_list, mapping, lengths, cache, at_odd_offsets(objs) if scenario.odd_objects else objs


def _label(objs: list[Any], connector: Any) -> None:
    """Give stored objects the connector's format, as an offload layer keeps it with them."""
    for group in objs:
        for o in group if isinstance(group, list) else [group]:
            o.metadata.fmt = connector.format


#: The factor a scenario reads from its cache's tensors where the spec names one (`H/g`, `H%g`).
NAMED_FACTOR = 2


def _round_up(n: int, f: int) -> int:
    return -(-n // f) * f


def manager_extents(paged: Spec, ext: Mapping[str, int]) -> dict[str, int]:
    """The blocks the slot mapping addresses: the cache's, or for `slots_per_token` k blocks of
    N / k tokens (the engine manager's; each of its slots stands for k stored slots)."""
    per = paged.token_ratio[1]
    return {**ext, "N": ext["N"] // per} if per > 1 else dict(ext)


def fitted(paged: Spec, scenario: Scenario) -> Scenario:
    """The scenario at extents a cache's split axes (format 3 tiles) divide: N and H at the
    spec's fixed extent or rounded up to a multiple of every factor that splits them, and each
    part that splits C given a width its factors divide where the scenario gives it none
    (planes.parts_extents keeps it). A factor read from the tensor (`H%g`) is NAMED_FACTOR where
    the scenario gives it none, with H at least twice it: several groups of several heads."""
    ext = dict(scenario.ext)
    factors: dict[str, int] = {}
    for i, part in enumerate(paged.parts):
        for axis in part.tensor_axes:
            split = split_of(axis)
            if split is None:
                continue
            base, _, f = split
            if isinstance(f, str):
                f = ext.setdefault(place_of(base, f), NAMED_FACTOR)
                ext[base] = max(ext[base], 2 * f)
            if base == "C":
                ext.setdefault(f"C.{part.name}", part.size("C") or _round_up(ext["C"] + 2 * i, f))
            else:
                factors[base] = math.lcm(factors.get(base, 1), f)
    per = paged.token_ratio[1]
    if per > 1:  # k stored slots per token: blocks of the scenario's N tokens, k slots each
        ext["N"] = scenario.ext["N"] * per
    if not factors and ext == scenario.ext:
        return scenario
    for base, f in factors.items():
        ext[base] = paged.size(base) or _round_up(ext[base], f)
    return replace(scenario, ext=ext)


def check_pair(connector: Any, paged: Spec, obj: Spec, scenario: Scenario,
               dtype: torch.dtype = torch.float32) -> tuple[bool, bool]:
    """(store ok, load ok) of one generated connector of (paged, obj), made for a device,
    against the reference."""
    scenario = fitted(paged, scenario)
    mapping_list, mapping, lengths, cache, objs = _pair_inputs(connector, paged, obj, scenario, dtype)
    want = make_objects(connector, lengths, dtype, str(connector.device), salt=7)
    connector_store(connector, objs, scenario, cache, mapping)
    reference_store(paged, obj, cache, want, scenario, mapping_list)
    store_ok = same_bits([obj_tensors(o) for o in objs], [obj_tensors(o) for o in want])

    _label(objs, connector)
    expected = clone_tree(cache)
    connector_load(connector, objs, scenario, cache, mapping)
    reference_load(paged, obj, expected, objs, scenario, mapping_list)
    return store_ok, same_bits(cache, expected)


def move_pair(connector: Any, paged: Spec, obj: Spec, scenario: Scenario,
              dtype: torch.dtype = torch.float32) -> None:
    """check_pair's store and load through the connector alone, nothing compared (what a
    rehearsal of its kernel launches runs, kvgen.tools.verify.connectors)."""
    scenario = fitted(paged, scenario)
    _, mapping, _, cache, objs = _pair_inputs(connector, paged, obj, scenario, dtype)
    connector_store(connector, objs, scenario, cache, mapping)
    _label(objs, connector)
    connector_load(connector, objs, scenario, cache, mapping)


def check_backends(connectors: Sequence[Any], paged: Spec, obj: Spec, scenario: Scenario,
                   dtype: torch.dtype = torch.float32) -> list[tuple[bool, bool]]:
    """check_pair of each of several connectors of one pair (one per backend) in one scenario,
    the reference run once for all of them. Each stores from a fresh coded cache, compared with
    the reference's objects; each then loads the reference's objects (what a right store gives),
    written into its own objects (at their storage offsets), into that cache, compared with the
    reference's load of them into an untouched copy."""
    scenario = fitted(paged, scenario)
    mapping_list, _, lengths, cache, _ = _pair_inputs(connectors[0], paged, obj, scenario, dtype)
    want = make_objects(connectors[0], lengths, dtype, str(connectors[0].device), salt=7)
    reference_store(paged, obj, cache, want, scenario, mapping_list)
    _label(want, connectors[0])
    expected = clone_tree(cache)
    reference_load(paged, obj, expected, want, scenario, mapping_list)
    results = []
    for connector in connectors:
        _, mapping, _, mine, objs = _pair_inputs(connector, paged, obj, scenario, dtype)
        connector_store(connector, objs, scenario, mine, mapping)
        store_ok = same_bits([obj_tensors(o) for o in objs], [obj_tensors(o) for o in want])
        for got, right in zip(tensors_of([obj_tensors(o) for o in objs]), tensors_of([obj_tensors(o) for o in want]),
                              strict=True):
            got.copy_(right)
        _label(objs, connector)
        connector_load(connector, objs, scenario, mine, mapping)
        results.append((store_ok, same_bits(mine, expected)))
    return results


def check_connector(package: Any, paged: Spec, obj: Spec, device: str, scenarios: Sequence[Scenario],
                    **options: Any) -> list[tuple[bool, bool]]:
    """check_pair for each scenario in turn through one connector (built with `options`),
    as an engine keeps one: each new cache (other strides, other storage offsets) must be
    met afresh, never with what the connector worked out for an earlier one."""
    connector = package.get(paged.name, obj.name)(device=device, **options)
    return [check_pair(connector, paged, obj, sc) for sc in scenarios]
