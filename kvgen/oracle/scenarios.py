"""Test scenarios shared by the test suite and `kvgen verify`: small coordinate-coded
caches and objects, slot-mapping scenarios, and one transfer run through a connector and
through the reference. Cache elements carry the code of their coordinates (layer, kv, slot, head,
c), objects codes of their own positions; comparisons are bitwise.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvgen.oracle import reference
from kvgen.runtime import MemoryObj
from kvgen.runtime.ops import bits
from kvgen.spec.model import Spec

#: Small geometry: 3 layers, 2 heads, 4 values per head, 12 blocks of 4 slots.
EXT = {"L": 3, "KV": 2, "H": 2, "C": 4, "N": 4, "B": 12}


def block_table_mapping(seq_len: int, rng: random.Random, ext: dict[str, int]) -> list[int]:
    """vLLM-style: the sequence fills blocks in random order, N slots each."""
    blocks = rng.sample(range(ext["B"]), ext["B"])
    return [blocks[i // ext["N"]] * ext["N"] + i % ext["N"] for i in range(seq_len)]


@dataclass(frozen=True)
class Scenario:
    name: str
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    mapping: Callable[[random.Random, dict[str, int]], list[int]]
    strided: bool = False
    offset: int = 0

    @property
    def seq_len(self) -> int:
        return max(self.ends)


def _random_slots(rng: random.Random, ext: dict[str, int]) -> list[int]:
    return rng.sample(range(ext["B"] * ext["N"]), 20)


def _prefix_hit(rng: random.Random, ext: dict[str, int]) -> list[int]:
    return [-1] * 6 + block_table_mapping(16, rng, ext)[6:]


SCENARIOS = {
    s.name: s for s in (
        Scenario("random_slots", (0,), (20,), _random_slots),
        Scenario("whole_blocks", (0,), (16,), lambda r, e: block_table_mapping(16, r, e)),
        Scenario("partial_blocks", (2,), (15,), lambda r, e: block_table_mapping(15, r, e)),
        Scenario("minus1_prefix", (0,), (16,), _prefix_hit),
        Scenario("noncontiguous_chunks", (0, 7, 19), (4, 13, 25), lambda r, e: block_table_mapping(25, r, e)),
        Scenario("consecutive_blocks", (0,), (16,), lambda r, e: [e["N"] * 3 + i for i in range(16)]),
        Scenario("strided_cache", (0,), (16,), lambda r, e: block_table_mapping(16, r, e), strided=True),
    )
}


def allocate(shape: Sequence[int], dtype: torch.dtype, device: str, strided: bool) -> torch.Tensor:
    """A tensor of `shape`; when strided, a view into a larger buffer with every dim
    permuted and a storage offset, as engines hand out per-layer views."""
    if not strided:
        return torch.zeros(tuple(shape), dtype=dtype, device=device)
    rev = tuple(reversed(shape))
    big = torch.zeros((rev[0] + 1, *rev[1:]), dtype=dtype, device=device)[1:]
    return big.permute(*reversed(range(len(shape))))


def make_cache(paged: Spec, dtype: torch.dtype, device: str, strided: bool = False) -> Any:
    shape = reference.leaf_shape(paged, EXT)
    cache = reference.nest(paged, EXT, lambda path: allocate(shape, dtype, device, strided))
    reference.fill_cache(paged, EXT, cache, dtype)
    return cache


def clone_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    return type(tree)(clone_tree(t) for t in tree)


def tensors_of(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    return [t for sub in tree for t in tensors_of(sub)]


def same_bits(a: Any, b: Any) -> bool:
    return all(torch.equal(bits(x).cpu(), bits(y).cpu()) for x, y in zip(tensors_of(a), tensors_of(b), strict=True))


def make_objects(connector: Any, layerwise: bool, lengths: Sequence[int], dtype: torch.dtype,
                 device: str, salt: int, fmt: Any = None) -> list[Any]:
    """Objects per chunk, filled with codes distinct from the cache's: one tensor per
    chunk, or (layerwise) a list of per-layer tensors per chunk."""
    out = []
    for i, n in enumerate(lengths):
        shape = connector.get_shape(n)
        if layerwise:
            layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(connector.geometry.L)]
            reference.fill_object(layers, dtype, salt + 100000 * i)
            out.append([MemoryObj(t, fmt) for t in layers])
        else:
            t = torch.zeros(shape, dtype=dtype, device=device)
            reference.fill_object([t], dtype, salt + 100000 * i)
            out.append(MemoryObj(t, fmt))
    return out


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


def connector_load(connector: Any, objs: list[Any], sc: Scenario, cache: Any, mapping: torch.Tensor,
                   *, skip: int = 0, sync: bool = True) -> int:
    if not connector.layerwise:
        connector.batched_to_gpu(objs, sc.starts, sc.ends, kvcaches=cache, slot_mapping=mapping,
                                 offset=sc.offset, skip_prefix_n_tokens=skip)
        return 0
    gen = connector.batched_to_gpu(sc.starts, sc.ends, kvcaches=cache, slot_mapping=mapping, sync=sync,
                                   offset=sc.offset, skip_prefix_n_tokens=skip)
    yields = 1
    next(gen)
    for layer in range(connector.geometry.L):
        gen.send([chunk[layer] for chunk in objs])
        yields += 1
    next(gen)
    return yields + 1


def reference_store(paged: Spec, obj: Spec, cache: Any, objs: list[Any], sc: Scenario,
                    mapping: Sequence[int]) -> None:
    for o, s, e in zip(objs, sc.starts, sc.ends, strict=False):
        reference.store(paged, obj, EXT, cache, obj_tensors(o), mapping, s, e, sc.offset)


def reference_load(paged: Spec, obj: Spec, cache: Any, objs: list[Any], sc: Scenario,
                   mapping: Sequence[int], skip: int = 0) -> None:
    for o, s, e in zip(objs, sc.starts, sc.ends, strict=False):
        reference.load(paged, obj, EXT, cache, obj_tensors(o), mapping, s, e, sc.offset, skip)


def check_pair(package: Any, paged: Spec, obj: Spec, device: str, scenario: Scenario,
               dtype: torch.dtype = torch.float32) -> tuple[bool, bool]:
    """(store ok, load ok) of one generated connector against the reference."""
    rng = random.Random(f"{paged.name}/{obj.name}/{scenario.name}")
    mapping_list = scenario.mapping(rng, EXT)
    mapping = torch.tensor(mapping_list, dtype=torch.long, device=device)
    connector = package.get(paged.name, obj.name)(device=device)
    lengths = [e - s for s, e in zip(scenario.starts, scenario.ends, strict=False)]

    cache = make_cache(paged, dtype, device, scenario.strided)
    connector.bind(cache)
    objs = make_objects(connector, connector.layerwise, lengths, dtype, device, salt=7)
    want = make_objects(connector, connector.layerwise, lengths, dtype, device, salt=7)
    connector_store(connector, objs, scenario, cache, mapping)
    reference_store(paged, obj, cache, want, scenario, mapping_list)
    store_ok = same_bits([obj_tensors(o) for o in objs], [obj_tensors(o) for o in want])

    for group in objs:
        for o in group if isinstance(group, list) else [group]:
            o.metadata.fmt = connector.format
    expected = clone_tree(cache)
    connector_load(connector, objs, scenario, cache, mapping)
    reference_load(paged, obj, expected, objs, scenario, mapping_list)
    return store_ok, same_bits(cache, expected)
