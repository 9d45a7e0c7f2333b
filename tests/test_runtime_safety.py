"""Connectors never write through a stale binding, across threads, into aliased memory, with
mistyped keywords or on a device that is not there.

Data is checked bit for bit against the reference interpreter (kvgen.oracle) on
coordinate-coded caches; every refusal is checked to leave cache and objects unchanged.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from harness import clone_tree, same_bits

from kvgen import generated
from kvgen.oracle import reference
from kvgen.runtime import KVLayoutError, MemoryObj
from kvgen.spec.library import load_library

LIB = load_library()
NHD = "vllm_flash_attn_nhd"
WHOLE, LAYERWISE = "kv_2ltd", "kv_t2d"
#: bf16 with C=8: a head is 16 bytes, so a contiguous cache moves as 16-byte words.
WIDE = {"L": 3, "KV": 2, "H": 2, "C": 8, "N": 4, "B": 6}
#: float32, C=4, more blocks: another geometry for the same layout.
SMALL = {"L": 3, "KV": 2, "H": 2, "C": 4, "N": 4, "B": 12}
STARTS, ENDS = (0, 8), (6, 13)


# -- caches of any geometry and memory arrangement -------------------------------------------------


def contiguous(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def odd_offset(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Storage offset 1: only words of one element fit."""
    n = 1
    for s in shape:
        n *= s
    return torch.zeros(n + 1, dtype=dtype)[1:].view(shape)


def permuted(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Every dim permuted, with a storage offset (as engines hand out views)."""
    rev = tuple(reversed(shape))
    return torch.zeros((rev[0] + 1, *rev[1:]), dtype=dtype)[1:].permute(*reversed(range(len(shape))))


def build_cache(ext: dict[str, int], dtype: torch.dtype, alloc: Callable[..., torch.Tensor] = contiguous,
                paged: str = NHD, salt: int = 0) -> Any:
    spec = LIB[paged]
    shape = reference.leaf_shape(spec, ext)
    cache = reference.nest(spec, ext, lambda path: alloc(shape, dtype))
    reference.fill_cache(spec, ext, cache, dtype, salt)
    return cache


def mapping_for(ext: dict[str, int], seq: int, seed: int) -> list[int]:
    """A block table in random order, with a -1 token."""
    rng = random.Random(seed)
    blocks = rng.sample(range(ext["B"]), ext["B"])
    out = [blocks[i // ext["N"]] * ext["N"] + i % ext["N"] for i in range(seq)]
    out[3] = -1
    return out


def make_objs(conn: Any, kvcaches: Any, lengths: list[int], salt: int, fmt: Any = None) -> list[Any]:
    """Objects per chunk (a list of per-layer objects when layerwise), position-coded."""
    g = conn.bind(kvcaches)
    out: list[Any] = []
    for i, n in enumerate(lengths):
        shape = conn.get_shape(n)
        if conn.layerwise:
            layers = [torch.zeros(shape, dtype=g.dtype) for _ in range(g.L)]
            reference.fill_object(layers, g.dtype, salt + 100000 * i)
            out.append([MemoryObj(t, fmt) for t in layers])
        else:
            t = torch.zeros(shape, dtype=g.dtype)
            reference.fill_object([t], g.dtype, salt + 100000 * i)
            out.append(MemoryObj(t, fmt))
    return out


def tensors(objs: list[Any]) -> list[Any]:
    return [[o.tensor for o in c] if isinstance(c, list) else c.tensor for c in objs]


def run_store(conn: Any, objs: list[Any], kvcaches: Any, mapping: torch.Tensor,
              starts: Any = STARTS, ends: Any = ENDS, **kwargs: Any) -> None:
    if not conn.layerwise:
        conn.batched_from_gpu(objs, starts, ends, kvcaches=kvcaches, slot_mapping=mapping, **kwargs)
        return
    layers = len(objs[0])
    per_layer = [[c[layer] for c in objs] for layer in range(layers)]
    for _ in conn.batched_from_gpu(per_layer, starts, ends, kvcaches=kvcaches, slot_mapping=mapping, **kwargs):
        pass


def run_load(conn: Any, objs: list[Any], kvcaches: Any, mapping: torch.Tensor,
             starts: Any = STARTS, ends: Any = ENDS, **kwargs: Any) -> None:
    if not conn.layerwise:
        conn.batched_to_gpu(objs, starts, ends, kvcaches=kvcaches, slot_mapping=mapping, **kwargs)
        return
    gen = conn.batched_to_gpu(starts, ends, kvcaches=kvcaches, slot_mapping=mapping, **kwargs)
    next(gen)
    for layer in range(len(objs[0])):
        gen.send([c[layer] for c in objs])
    next(gen, None)


def ref_store(obj: str, ext: dict[str, int], kvcaches: Any, objs: list[Any], mapping: list[int],
              starts: Any = STARTS, ends: Any = ENDS) -> None:
    for t, s, e in zip(tensors(objs), starts, ends, strict=True):
        reference.store(LIB[NHD], LIB[obj], ext, kvcaches, t, mapping, s, e)


def ref_load(obj: str, ext: dict[str, int], kvcaches: Any, objs: list[Any], mapping: list[int],
             starts: Any = STARTS, ends: Any = ENDS, skip: int = 0) -> None:
    for t, s, e in zip(tensors(objs), starts, ends, strict=True):
        reference.load(LIB[NHD], LIB[obj], ext, kvcaches, t, mapping, s, e, 0, skip)


def check_store(conn: Any, obj: str, ext: dict[str, int], kvcaches: Any, seed: int = 1) -> None:
    """One store through `conn` equals the reference, and leaves the cache as it was."""
    mapping = mapping_for(ext, ENDS[-1], seed)
    lengths = [e - s for s, e in zip(STARTS, ENDS, strict=True)]
    got, want = make_objs(conn, kvcaches, lengths, 7), make_objs(conn, kvcaches, lengths, 7)
    before = clone_tree(kvcaches)
    run_store(conn, got, kvcaches, torch.tensor(mapping))
    ref_store(obj, ext, kvcaches, want, mapping)
    assert same_bits(tensors(got), tensors(want)), "stored objects differ from the reference"
    assert same_bits(kvcaches, before)


def check_load(conn: Any, obj: str, ext: dict[str, int], kvcaches: Any, seed: int = 1) -> None:
    mapping = mapping_for(ext, ENDS[-1], seed)
    lengths = [e - s for s, e in zip(STARTS, ENDS, strict=True)]
    objs = make_objs(conn, kvcaches, lengths, 500, conn.format)
    want = clone_tree(kvcaches)
    run_load(conn, objs, kvcaches, torch.tensor(mapping))
    ref_load(obj, ext, want, objs, mapping)
    assert same_bits(kvcaches, want), "loaded cache differs from the reference"


def snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return [snapshot(v) for v in value]
    if hasattr(value, "tensor"):
        return (snapshot(value.tensor), repr(value.metadata.fmt))
    return repr(value)


def unchanged(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(
            a.view(-1).view(torch.uint8) if a.numel() else a, b.view(-1).view(torch.uint8) if b.numel() else b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(unchanged(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(unchanged(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@contextmanager
def nothing_written(*values: Any) -> Iterator[None]:
    """The block must change none of `values` (tensors, objects, nested lists of them)."""
    before = snapshot(list(values))
    yield
    assert unchanged(snapshot(list(values)), before), "a refused call wrote something"


def connector(obj: str, **kwargs: Any) -> Any:
    return generated.get(NHD, obj)(**kwargs)


# -- 1. stale binding -------------------------------------------------------------------------------


@pytest.mark.parametrize("obj", [WHOLE, LAYERWISE])
@pytest.mark.parametrize("direction", ["store", "load"])
def test_replaced_leaf_of_another_shape_is_refused_before_any_write(obj: str, direction: str) -> None:
    """`cache[2] = other` with fewer blocks: the whole cache is checked again, nothing moves."""
    conn = connector(obj)
    cache = build_cache(SMALL, torch.float32)
    lengths = [e - s for s, e in zip(STARTS, ENDS, strict=True)]
    objs = make_objs(conn, cache, lengths, 9, conn.format if direction == "load" else None)
    check_store(conn, obj, SMALL, cache)  # bound and used
    cache[2] = build_cache({**SMALL, "B": 2}, torch.float32)[2]
    mapping = torch.tensor(mapping_for(SMALL, ENDS[-1], 1))
    with nothing_written(cache, objs), pytest.raises(KVLayoutError, match="one shape, dtype and device"):
        (run_store if direction == "store" else run_load)(conn, objs, cache, mapping)


@pytest.mark.parametrize("obj", [WHOLE, LAYERWISE])
def test_appended_layer_is_moved(obj: str) -> None:
    conn = connector(obj)
    cache = build_cache(SMALL, torch.float32)
    lengths = [e - s for s, e in zip(STARTS, ENDS, strict=True)]
    three = make_objs(conn, cache, lengths, 9, conn.format)
    check_store(conn, obj, SMALL, cache)
    four = {**SMALL, "L": 4}
    cache.append(build_cache(four, torch.float32)[3])  # codes of layer 3
    assert conn.bind(cache).L == 4
    check_store(conn, obj, four, cache)
    check_load(conn, obj, four, cache)
    if obj == WHOLE:  # objects made for three layers no longer fit
        with nothing_written(cache, three), pytest.raises(KVLayoutError, match="L=4"):
            run_load(conn, three, cache, torch.tensor(mapping_for(SMALL, ENDS[-1], 1)))


@pytest.mark.parametrize("obj", [WHOLE, LAYERWISE])
@pytest.mark.parametrize("how", ["strides", "geometry"])
def test_list_rebound_with_new_tensors(obj: str, how: str) -> None:
    """The same list object holding new tensors is a new cache: keying the binding by the
    list's identity alone would move it with the old word width or extents."""
    conn = connector(obj)
    ext = WIDE
    cache = build_cache(ext, torch.bfloat16)
    check_store(conn, obj, ext, cache)
    if how == "strides":
        fresh = build_cache(ext, torch.bfloat16, odd_offset, salt=3)
    else:
        ext = {**WIDE, "B": 9, "N": 2}
        fresh = build_cache(ext, torch.bfloat16, permuted, salt=3)
    cache[:] = fresh
    check_store(conn, obj, ext, cache, seed=2)
    check_load(conn, obj, ext, cache, seed=2)


@pytest.mark.parametrize("obj", [WHOLE, LAYERWISE])
def test_replaced_later_leaf_with_narrower_words(obj: str) -> None:
    """Only layer 1 changes (the first tensor stays): it allows 2-byte words where the
    others allowed 16; a width kept from the first binding cannot move it."""
    conn = connector(obj)
    cache = build_cache(WIDE, torch.bfloat16)
    check_load(conn, obj, WIDE, cache)
    cache[1] = build_cache(WIDE, torch.bfloat16, odd_offset)[1]
    check_store(conn, obj, WIDE, cache, seed=3)
    check_load(conn, obj, WIDE, cache, seed=3)


@pytest.mark.parametrize("obj", [WHOLE, LAYERWISE])
def test_one_connector_meets_caches_with_different_strides(obj: str) -> None:
    """Word widths are the cache's: 16-byte words for the first cache, 2-byte for the next,
    then 16 again (a connector that worked them out once would fail the second)."""
    conn = connector(obj)
    for alloc in (contiguous, odd_offset, permuted, contiguous):
        cache = build_cache(WIDE, torch.bfloat16, alloc)
        check_store(conn, obj, WIDE, cache)
        check_load(conn, obj, WIDE, cache)


def test_layerwise_load_moves_the_cache_it_was_called_with() -> None:
    """A list changed between two send()s does not redirect the rest of the load: it goes
    to the tensors that were checked when the generator started."""
    conn = connector(LAYERWISE)
    cache = build_cache(SMALL, torch.float32)
    original = list(cache)
    want = clone_tree(cache)
    mapping = mapping_for(SMALL, ENDS[-1], 4)
    objs = make_objs(conn, cache, [6, 5], 40, conn.format)
    stranger = build_cache({**SMALL, "B": 2}, torch.float32)[1]
    stranger_before = stranger.clone()
    gen = conn.batched_to_gpu(STARTS, ENDS, kvcaches=cache, slot_mapping=torch.tensor(mapping))
    next(gen)
    gen.send([c[0] for c in objs])
    cache[1] = stranger
    for layer in (1, 2):
        gen.send([c[layer] for c in objs])
    next(gen, None)
    ref_load(LAYERWISE, SMALL, want, objs, mapping)
    assert same_bits(original, want) and torch.equal(stranger, stranger_before)


def test_bind_is_cached_per_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two caches used in turn are read once each, not once per switch."""
    import kvgen.runtime.connector as connector_module

    calls: list[int] = []
    real = connector_module.read_geometry
    monkeypatch.setattr(connector_module, "read_geometry", lambda *a: calls.append(1) or real(*a))
    conn = connector(WHOLE)
    a, b = build_cache(SMALL, torch.float32), build_cache(WIDE, torch.bfloat16)
    for _ in range(3):
        assert conn.bind(a).C == 4 and conn.bind(b).C == 8
    assert calls == [1, 1]


# -- 2. threads -------------------------------------------------------------------------------------


class Task:
    """One transfer with its expected result, computed once by the reference."""

    def __init__(self, obj: str, ext: dict[str, int], dtype: torch.dtype, alloc: Callable[..., torch.Tensor],
                 seed: int, conn: Any):
        self.obj, self.ext, self.dtype, self.alloc = obj, ext, dtype, alloc
        self.source = build_cache(ext, dtype, alloc)
        self.mapping_list = mapping_for(ext, ENDS[-1], seed)
        self.mapping = torch.tensor(self.mapping_list)
        lengths = [e - s for s, e in zip(STARTS, ENDS, strict=True)]
        self.blank = make_objs(conn, self.source, lengths, seed * 1000)
        self.stored = make_objs(conn, self.source, lengths, seed * 1000)
        ref_store(obj, ext, self.source, self.stored, self.mapping_list)
        for c in self.stored:
            for o in c if isinstance(c, list) else [c]:
                o.metadata.fmt = conn.format
        self.loaded = build_cache(ext, dtype, alloc)
        ref_load(obj, ext, self.loaded, self.stored, self.mapping_list)

    def fresh_objects(self) -> list[Any]:
        return [[MemoryObj(o.tensor.clone()) for o in c] if isinstance(c, list) else MemoryObj(c.tensor.clone())
                for c in self.blank]


@pytest.mark.parametrize("use_gpu", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("obj", [WHOLE, LAYERWISE])
def test_one_connector_shared_by_four_threads(obj: str, use_gpu: bool) -> None:
    """4 threads, 320 calls on one connector: stores and loads of three caches that differ
    in geometry, dtype and strides (so in word width), each result equal to the reference.
    use_gpu on the CPU runs the staging path too."""
    conn = connector(obj, use_gpu=use_gpu)
    tasks = [Task(obj, WIDE, torch.bfloat16, contiguous, 1, conn),
             Task(obj, WIDE, torch.bfloat16, odd_offset, 2, conn),
             Task(obj, SMALL, torch.float32, permuted, 3, conn)]
    calls, threads_n = 80, 4
    failures: list[str] = []
    start = threading.Barrier(threads_n)

    def worker(index: int) -> None:
        targets = [build_cache(t.ext, t.dtype, t.alloc) for t in tasks]  # this thread's caches to load into
        start.wait()
        for call in range(calls):
            k = (index + call) % len(tasks)
            task = tasks[k]
            try:
                if (index + call // len(tasks)) % 2:
                    objs = task.fresh_objects()
                    run_store(conn, objs, task.source, task.mapping)
                    if not same_bits(tensors(objs), tensors(task.stored)):
                        failures.append(f"thread {index} call {call}: wrong objects from cache {k}")
                else:
                    run_load(conn, task.stored, targets[k], task.mapping)
                    if not same_bits(targets[k], task.loaded):
                        failures.append(f"thread {index} call {call}: wrong cache {k}")
            except Exception as error:  # noqa: BLE001 - every failure is a finding here
                failures.append(f"thread {index} call {call}: {type(error).__name__}: {error}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, so races show
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(threads_n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not failures, f"{len(failures)} of {calls * threads_n} calls failed:\n" + "\n".join(failures[:10])
