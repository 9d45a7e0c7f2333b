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
from harness import builtin_library, clone_tree, same_bits

from kvgen import generated
from kvgen.errors import KVGenError
from kvgen.oracle import reference
from kvgen.runtime import KVLayoutError, MemoryObj, available_devices

LIB = builtin_library()
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
    shape = reference.layouts.leaf_shape(spec, ext)
    cache = reference.layouts.nest(spec, ext, lambda path: alloc(shape, dtype))
    reference.layouts.fill_cache(spec, ext, cache, dtype, salt)
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
            reference.layouts.fill_object(layers, g.dtype, salt + 100000 * i)
            out.append([MemoryObj(t, fmt) for t in layers])
        else:
            t = torch.zeros(shape, dtype=g.dtype)
            reference.layouts.fill_object([t], g.dtype, salt + 100000 * i)
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
        reference.store(LIB[NHD], LIB[obj], ext, kvcaches, t, reference.Span(mapping, s, e))


def ref_load(obj: str, ext: dict[str, int], kvcaches: Any, objs: list[Any], mapping: list[int],
             starts: Any = STARTS, ends: Any = ENDS, skip: int = 0) -> None:
    for t, s, e in zip(tensors(objs), starts, ends, strict=True):
        reference.load(LIB[NHD], LIB[obj], ext, kvcaches, t, reference.Span(mapping, s, e, 0, skip))


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
    calls: list[int] = []
    conn = connector(WHOLE)
    real = type(conn).read_geometry
    monkeypatch.setattr(type(conn), "read_geometry", staticmethod(lambda c: calls.append(1) or real(c)))
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


# -- 3. inputs that alias ---------------------------------------------------------------------------

#: Two chunks of equal length, so one object could (wrongly) serve both.
EVEN_STARTS, EVEN_ENDS = (0, 6), (6, 12)


def even_objs(conn: Any, cache: Any, direction: str, salt: int = 21) -> list[Any]:
    return make_objs(conn, cache, [6, 6], salt, conn.format if direction == "load" else None)


def run(direction: str, conn: Any, objs: list[Any], cache: Any, mapping: list[int] | torch.Tensor,
        starts: Any = EVEN_STARTS, ends: Any = EVEN_ENDS, **kwargs: Any) -> None:
    move = run_store if direction == "store" else run_load
    move(conn, objs, cache, torch.as_tensor(mapping), starts, ends, **kwargs)


def first_checked_layer(direction: str) -> int:
    """Where a bad layerwise object goes so that nothing at all may be written: the last
    layer of a store (all are checked first), layer 0 of a load (each layer is checked as it
    arrives, so layers before a bad one are loaded; see the layerwise tests below)."""
    return 2 if direction == "store" else 0


def replace(objs: list[Any], chunk: int, layer: int | None, new: Any) -> None:
    if layer is None:
        objs[chunk] = new
    else:
        objs[chunk][layer] = new


@pytest.mark.parametrize("obj", [WHOLE, LAYERWISE])
@pytest.mark.parametrize("where", ["one_chunk", "two_chunks"])
def test_load_refuses_duplicate_slots(obj: str, where: str) -> None:
    """Two tokens of one load for one slot: the last would silently win."""
    conn = connector(obj)
    cache = build_cache(SMALL, torch.float32)
    mapping = mapping_for(SMALL, 12, 5)
    first, second = (1, 4) if where == "one_chunk" else (2, 10)
    mapping[second] = mapping[first]
    objs = even_objs(conn, cache, "load")
    expected = rf"slot {mapping[first]} is written by more than one token .*tokens \[{first}, {second}\]"
    with nothing_written(cache, objs), pytest.raises(KVLayoutError, match=expected):
        run("load", conn, objs, cache, mapping)


@pytest.mark.parametrize("obj", [WHOLE, LAYERWISE])
def test_repeated_slots_that_move_nothing_are_fine(obj: str) -> None:
    """-1 repeats; a repeat inside the skipped prefix; a store reading one slot twice."""
    conn = connector(obj)
    cache = build_cache(SMALL, torch.float32)
    mapping = mapping_for(SMALL, 12, 6)
    mapping[0] = mapping[7]  # token 0 is skipped in the load
    mapping[3] = mapping[9] = -1
    objs = even_objs(conn, cache, "load")
    want = clone_tree(cache)
    run("load", conn, objs, cache, mapping, skip_prefix_n_tokens=1)
    ref_load(obj, SMALL, want, objs, mapping, EVEN_STARTS, EVEN_ENDS, skip=1)
    assert same_bits(cache, want)
    got, expected = even_objs(conn, cache, "store"), even_objs(conn, cache, "store")
    run("store", conn, got, cache, mapping)
    ref_store(obj, SMALL, cache, expected, mapping, EVEN_STARTS, EVEN_ENDS)
    assert same_bits(tensors(got), tensors(expected))


def folded(t: torch.Tensor) -> torch.Tensor:
    """`t`'s shape over a buffer half its size: the token dim steps half a token, so
    neighbouring tokens share elements (no stride is 0)."""
    shape, strides = list(t.shape), list(t.contiguous().stride())
    tok = next(i for i, n in enumerate(shape) if n == 6)  # the token dim of a 6-token object
    strides[tok] = max(1, strides[tok] // 2)
    return torch.zeros(t.numel(), dtype=t.dtype).as_strided(shape, strides)


@pytest.mark.parametrize("obj", [WHOLE, LAYERWISE])
@pytest.mark.parametrize("direction", ["store", "load"])
def test_object_overlapping_itself(obj: str, direction: str) -> None:
    conn = connector(obj)
    cache = build_cache(SMALL, torch.float32)
    objs = even_objs(conn, cache, direction)
    layer = None if obj == WHOLE else first_checked_layer(direction)
    victim = objs[1] if layer is None else objs[1][layer]
    replace(objs, 1, layer, MemoryObj(folded(victim.tensor), victim.metadata.fmt))
    with nothing_written(cache, objs), pytest.raises(KVLayoutError, match="may address one element twice"):
        run(direction, conn, objs, cache, mapping_for(SMALL, 12, 7))


@pytest.mark.parametrize("direction", ["store", "load"])
def test_cache_tensor_overlapping_itself(direction: str) -> None:
    """A cache view whose tokens step by one head: slots share elements."""
    conn = connector(WHOLE)
    ext = SMALL
    cache = build_cache(ext, torch.float32)
    t = cache[1]
    kv, b, n, h, c = t.shape
    cache[1] = t.as_strided(t.shape, (b * n * h * c, n * h * c, c, c, 1))
    objs = even_objs(conn, build_cache(ext, torch.float32), direction)
    with nothing_written(cache, objs), pytest.raises(KVLayoutError, match=r"cache tensor kvcaches\[1\] may address "
                                                                          "one element twice"):
        run(direction, conn, objs, cache, mapping_for(ext, 12, 8))


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("how", ["same_tensor", "shifted_view"])
def test_cache_tensors_sharing_memory(direction: str, how: str) -> None:
    conn = connector(WHOLE)
    good = build_cache(SMALL, torch.float32)
    objs = even_objs(conn, good, direction)
    cache = build_cache(SMALL, torch.float32)
    if how == "same_tensor":
        cache[2] = cache[0]
        match = r"cache tensors kvcaches\[0\] and kvcaches\[2\] are the same memory"
    else:  # layer 2 starts one token into layer 1's memory
        flat = torch.zeros(cache[1].numel() * 2, dtype=torch.float32)
        step = cache[1].stride(2)
        cache[1] = flat[:cache[1].numel()].view(cache[1].shape)
        cache[2] = flat[step:step + cache[2].numel()].view(cache[2].shape)
        match = r"cache tensors kvcaches\[1\] and kvcaches\[2\] share memory"
    with nothing_written(cache, objs), pytest.raises(KVLayoutError, match=match):
        run(direction, conn, objs, cache, mapping_for(SMALL, 12, 9))


@pytest.mark.parametrize("obj", [WHOLE, LAYERWISE])
def test_interleaved_cache_tensors_are_fine(obj: str) -> None:
    """Per-layer views of one allocation [KV B L N H C]: every layer's byte range spans the
    others', yet no element is shared. Moved exactly like separate tensors."""
    spec = LIB[NHD]
    kv, b, n, h, c = reference.layouts.leaf_shape(spec, SMALL)
    big = torch.zeros(kv, b, SMALL["L"], n, h, c)
    cache = [big[:, :, layer] for layer in range(SMALL["L"])]
    reference.layouts.fill_cache(spec, SMALL, cache, torch.float32)
    conn = connector(obj)
    check_store(conn, obj, SMALL, cache)
    check_load(conn, obj, SMALL, cache)


@pytest.mark.parametrize("obj", [WHOLE, LAYERWISE])
@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("how", ["same_object", "same_tensor", "overlapping_view"])
def test_objects_of_two_chunks_sharing_memory(obj: str, direction: str, how: str) -> None:
    conn = connector(obj)
    cache = build_cache(SMALL, torch.float32)
    objs = even_objs(conn, cache, direction)
    layer = None if obj == WHOLE else first_checked_layer(direction)
    first = objs[0] if layer is None else objs[0][layer]
    if how == "same_object":
        new = first
    elif how == "same_tensor":
        new = MemoryObj(first.tensor, first.metadata.fmt)
    else:  # a second object one token into the first one's memory
        pool = torch.zeros(first.tensor.numel() * 2)
        pool[:first.tensor.numel()] = first.tensor.reshape(-1)
        step = first.tensor.numel() // 6
        replace(objs, 0, layer, MemoryObj(pool[:first.tensor.numel()].view(first.tensor.shape), first.metadata.fmt))
        new = MemoryObj(pool[step:step + first.tensor.numel()].view(first.tensor.shape), first.metadata.fmt)
    replace(objs, 1, layer, new)
    what = "are the same memory" if how != "overlapping_view" else "share memory"
    where = ("for chunk 0 and for chunk 1" if layer is None
             else f"for layer {layer}, chunk 0 and for layer {layer}, chunk 1")
    with nothing_written(cache, objs), pytest.raises(KVLayoutError, match=f"memory objects {where} {what}"):
        run(direction, conn, objs, cache, mapping_for(SMALL, 12, 10))


def test_objects_from_one_pool_are_fine() -> None:
    """Objects cut side by side from one buffer (as LMCache's allocator does) share nothing."""
    conn = connector(WHOLE)
    cache = build_cache(SMALL, torch.float32)
    mapping = mapping_for(SMALL, 12, 11)
    want = even_objs(conn, cache, "store")
    size = want[0].tensor.numel()
    pool = torch.zeros(3 * size)
    got = [MemoryObj(pool[i * size:(i + 1) * size].view(want[i].tensor.shape)) for i in (0, 1)]
    for g, w in zip(got, want, strict=True):
        g.tensor.copy_(w.tensor)
    run("store", conn, got, cache, mapping)
    ref_store(WHOLE, SMALL, cache, want, mapping, EVEN_STARTS, EVEN_ENDS)
    assert same_bits(tensors(got), tensors(want))


@pytest.mark.parametrize("obj", [WHOLE, LAYERWISE])
@pytest.mark.parametrize("direction", ["store", "load"])
def test_object_that_is_a_view_of_the_cache(obj: str, direction: str) -> None:
    conn = connector(obj)
    cache = build_cache(SMALL, torch.float32)
    objs = even_objs(conn, cache, direction)
    layer = None if obj == WHOLE else 0
    victim = objs[1] if layer is None else objs[1][layer]
    inside = cache[2].view(-1)[:victim.tensor.numel()].view(victim.tensor.shape)
    replace(objs, 1, layer, MemoryObj(inside, victim.metadata.fmt))
    with nothing_written(cache, objs), pytest.raises(KVLayoutError, match=r"shares memory with cache tensor "
                                                                          r"kvcaches\[2\]"):
        run(direction, conn, objs, cache, mapping_for(SMALL, 12, 12))


# -- 5. layerwise: what is checked before the first write -------------------------------------------


def layer_of(cache: list[torch.Tensor], layer: int) -> torch.Tensor:
    return cache[layer].clone()


def test_layerwise_store_checks_every_layer_before_the_first() -> None:
    """The last layer's object shares memory with the first layer's: refused before layer 0 moves."""
    conn = connector(LAYERWISE)
    cache = build_cache(SMALL, torch.float32)
    objs = even_objs(conn, cache, "store")
    objs[1][2] = MemoryObj(objs[0][0].tensor)
    with nothing_written(cache, objs), pytest.raises(KVLayoutError, match="for layer 0, chunk 0 and for layer 2, "
                                                                          "chunk 1 are the same memory"):
        run("store", conn, objs, cache, mapping_for(SMALL, 12, 13))


@pytest.mark.parametrize("bad", ["same_object", "view_of_cache", "overlapping_itself"])
def test_layerwise_load_refuses_a_layer_without_writing_any_of_it(bad: str) -> None:
    """Objects arrive a layer at a time: layer 0 is loaded, layer 1 is refused as a whole
    (its chunk 0 is not written either), layer 2 never arrives."""
    conn = connector(LAYERWISE)
    cache = build_cache(SMALL, torch.float32)
    objs = even_objs(conn, cache, "load")
    mapping = mapping_for(SMALL, 12, 14)
    want = clone_tree(cache)
    ref_load(LAYERWISE, SMALL, want, objs, mapping, EVEN_STARTS, EVEN_ENDS)  # its layer 0 is what must be loaded
    victim = objs[1][1]
    objs[1][1] = {
        "same_object": lambda: objs[0][1],
        "view_of_cache": lambda: MemoryObj(cache[0].view(-1)[:victim.tensor.numel()].view(victim.tensor.shape),
                                           conn.format),
        "overlapping_itself": lambda: MemoryObj(folded(victim.tensor), conn.format),
    }[bad]()
    before = [layer_of(cache, i) for i in range(3)]
    gen = conn.batched_to_gpu(EVEN_STARTS, EVEN_ENDS, kvcaches=cache, slot_mapping=torch.tensor(mapping))
    next(gen)
    gen.send([c[0] for c in objs])
    with pytest.raises(KVLayoutError):
        gen.send([c[1] for c in objs])
    assert same_bits(cache[0], want[0]), "layer 0 should be loaded exactly"
    assert not torch.equal(cache[0], before[0])
    assert torch.equal(cache[1], before[1]) and torch.equal(cache[2], before[2]), "a refused layer was written"


# -- 4. unknown keywords, 7. the generator protocol -------------------------------------------------


def whole_call(conn: Any, method: str, objs: list[Any], cache: Any, mapping: torch.Tensor, **kwargs: Any) -> None:
    if method in ("from_gpu", "to_gpu"):
        getattr(conn, method)(objs[0], 0, 6, kvcaches=cache, slot_mapping=mapping, **kwargs)
    else:
        getattr(conn, method)(objs, EVEN_STARTS, EVEN_ENDS, kvcaches=cache, slot_mapping=mapping, **kwargs)


@pytest.mark.parametrize(("method", "keyword", "accepted"), [
    ("from_gpu", "ofset", "kvcaches, slot_mapping, offset"),
    ("from_gpu", "skip_prefix_n_tokens", "kvcaches, slot_mapping, offset"),
    ("batched_from_gpu", "skip_prefix_n_tokens", "kvcaches, slot_mapping, offset"),
    ("to_gpu", "ofset", "kvcaches, slot_mapping, offset, skip_prefix_n_tokens"),
    ("batched_to_gpu", "skip_prefix", "kvcaches, slot_mapping, offset, skip_prefix_n_tokens"),
    ("batched_to_gpu", "sync", "kvcaches, slot_mapping, offset, skip_prefix_n_tokens"),
])
def test_whole_connector_names_an_unknown_keyword(method: str, keyword: str, accepted: str) -> None:
    conn = connector(WHOLE)
    cache = build_cache(SMALL, torch.float32)
    objs = even_objs(conn, cache, "load" if "to" in method else "store")
    with nothing_written(cache, objs), pytest.raises(TypeError, match=rf"{method}\(\) got an unexpected keyword "
                                                                      rf"argument '{keyword}'.*accepts: {accepted}$"):
        whole_call(conn, method, objs, cache, torch.tensor(mapping_for(SMALL, 12, 15)), **{keyword: 2})


@pytest.mark.parametrize(("method", "keyword", "accepted"), [
    ("batched_from_gpu", "skip_prefix_n_tokens", "kvcaches, slot_mapping, offset, sync"),
    ("batched_from_gpu", "ofset", "kvcaches, slot_mapping, offset, sync"),
    ("batched_to_gpu", "ofset", "kvcaches, slot_mapping, offset, skip_prefix_n_tokens, sync"),
])
def test_layerwise_connector_names_an_unknown_keyword(method: str, keyword: str, accepted: str) -> None:
    """Raised by the call itself, before the generator is even primed."""
    conn = connector(LAYERWISE)
    cache = build_cache(SMALL, torch.float32)
    objs = even_objs(conn, cache, "store")
    per_layer = [[c[layer] for c in objs] for layer in range(SMALL["L"])]
    args = (per_layer, EVEN_STARTS, EVEN_ENDS) if method == "batched_from_gpu" else (EVEN_STARTS, EVEN_ENDS)
    mapping = torch.tensor(mapping_for(SMALL, 12, 16))
    with nothing_written(cache, objs), pytest.raises(TypeError, match=rf"{method}\(\) got an unexpected keyword "
                                                                      rf"argument '{keyword}'.*accepts: {accepted}\."):
        getattr(conn, method)(*args, kvcaches=cache, slot_mapping=mapping, **{keyword: 2})


def test_did_you_mean() -> None:
    conn = connector(WHOLE)
    cache = build_cache(SMALL, torch.float32)
    objs = even_objs(conn, cache, "store")
    with pytest.raises(TypeError, match="'ofset' \\(did you mean 'offset'\\?\\)"):
        whole_call(conn, "from_gpu", objs, cache, torch.tensor(mapping_for(SMALL, 12, 15)), ofset=0)


def test_layerwise_generator_called_like_a_whole_transfer() -> None:
    conn = connector(LAYERWISE)
    cache = build_cache(SMALL, torch.float32)
    objs = even_objs(conn, cache, "load")
    mapping = torch.tensor(mapping_for(SMALL, 12, 17))
    with nothing_written(cache, objs):
        with pytest.raises(TypeError, match=r"batched_to_gpu\(\) of a layerwise connector takes 2 positional "
                                            r"arguments.*prime it with next\(gen\), then gen\.send\(objs\) once per "
                                            r"layer.*final next\(gen\) \(L \+ 2 steps in all\)"):
            conn.batched_to_gpu(objs, EVEN_STARTS, EVEN_ENDS, kvcaches=cache, slot_mapping=mapping)
        with pytest.raises(TypeError, match=r"batched_from_gpu\(\) of a layerwise connector takes 3 positional "
                                            r"arguments.*memory_objs\[layer\]\[chunk\].*\(L \+ 1 steps in all\)"):
            conn.batched_from_gpu(objs, EVEN_STARTS, EVEN_ENDS, cache, kvcaches=cache, slot_mapping=mapping)
        with pytest.raises(TypeError, match=r"batched_to_gpu\(\) is missing keyword arguments 'kvcaches', "
                                            r"'slot_mapping'\. batched_to_gpu is a generator"):
            conn.batched_to_gpu(EVEN_STARTS, EVEN_ENDS)
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'memory_objs'.*gen\.send\(objs\)"):
            conn.batched_to_gpu(EVEN_STARTS, EVEN_ENDS, memory_objs=objs, kvcaches=cache, slot_mapping=mapping)


# -- 6. devices -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpu", "gpu:0", "cuda0"])
def test_device_torch_does_not_know(name: str) -> None:
    with pytest.raises(KVLayoutError, match=rf"device '{name}' is not a device torch knows.*connectors run on: "
                                            r"cpu, cuda, xpu \(present here: cpu") as info:
        connector(WHOLE, device=name)
    assert isinstance(info.value, KVGenError)
    if name.startswith("gpu"):
        assert "an NVIDIA GPU is 'cuda', an Intel GPU 'xpu'" in str(info.value)


def test_device_without_a_backend() -> None:
    with pytest.raises(KVLayoutError, match="device 'meta': kvgen has no backend for device type 'meta'; "
                                            "known: cpu, cuda, xpu"):
        connector(WHOLE, device="meta")


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_absent_device_is_refused_at_construction(kind: str) -> None:
    """On a machine without the device, construction says what is missing; with it, an
    index past the last device is refused."""
    label = kind.upper()
    api = getattr(torch, kind, None)
    if kind in available_devices():
        count = api.device_count()
        name, why = f"{kind}:{count}", f"there is no {kind}:{count}: {count} {label} device"
    else:
        name = kind
        why = (f"was built without {label}" if kind == "cuda" and torch.version.cuda is None
               else f"no {label}")
    with pytest.raises(KVLayoutError, match=rf"device '{name}' is not available here: .*{why}") as info:
        connector(WHOLE, device=name)
    assert isinstance(info.value, KVGenError)


def test_present_devices_are_accepted() -> None:
    for kind in available_devices():
        assert connector(WHOLE, device=kind).device == torch.device(kind)
        assert connector(WHOLE, device=torch.device(kind)).device == torch.device(kind)


def test_registered_backend_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend registered with a probe is refused where the probe says it is missing."""
    from kvgen.runtime import devices

    monkeypatch.setattr(devices, "_DEVICES", dict(devices._DEVICES))
    devices.register_backend("mtia", lambda d: devices.CpuBackend(), probe=lambda d: "no MTIA board in this box")
    with pytest.raises(KVLayoutError, match="device 'mtia' is not available here: no MTIA board in this box"):
        connector(WHOLE, device="mtia")
    devices.register_backend("mtia", lambda d: devices.CpuBackend())
    assert connector(WHOLE, device="mtia").device == torch.device("mtia")


# -- the overlap arithmetic against brute force -----------------------------------------------------


def _offsets(shape: tuple[int, ...], strides: tuple[int, ...], base: int) -> list[int]:
    out = [base]
    for n, s in zip(shape, strides, strict=True):
        out = [o + i * s for o in out for i in range(n)]
    return out


def test_overlap_arithmetic_matches_brute_force() -> None:
    """overlaps_itself never misses a real overlap; share_elements is exact for equal strides
    (and never misses a shared element otherwise), on 3000 random small strided views."""
    from kvgen.runtime.aliasing import extent, overlaps_itself, share_elements

    rng = random.Random(2024)
    buf = torch.zeros(4096, dtype=torch.int16)
    exact = 0
    for _ in range(3000):
        dims = rng.randint(1, 4)
        shape = tuple(rng.randint(1, 4) for _ in range(dims))
        strides = tuple(rng.choice([0, 1, 2, 3, 4, 5, 8, 12, 16, 24, 40]) for _ in range(dims))
        a_off, b_off = rng.randint(0, 200), rng.randint(0, 200)
        a = buf.as_strided(shape, strides, a_off)
        other_strides = strides if rng.random() < 0.7 else tuple(rng.choice([1, 2, 4, 8, 16]) for _ in range(dims))
        b = buf.as_strided(shape, other_strides, b_off)
        elems_a = _offsets(shape, strides, a_off)
        elems_b = _offsets(shape, other_strides, b_off)
        if len(set(elems_a)) < len(elems_a):
            assert overlaps_itself(a), (shape, strides)
            continue
        if overlaps_itself(a) or overlaps_itself(b):
            continue
        truth = bool(set(elems_a) & set(elems_b))
        said = share_elements(extent(a), extent(b))
        if other_strides == strides:
            assert said == truth, (shape, strides, a_off, b_off)
            exact += 1
        else:
            assert said or not truth, (shape, strides, other_strides, a_off, b_off)
    assert exact > 1000


def _factors(n: int, rng: random.Random) -> tuple[int, ...]:
    """A random shape whose sizes multiply to n."""
    out = []
    while n > 1:
        f = rng.choice([d for d in range(2, n + 1) if n % d == 0])
        out.append(f)
        n //= f
    return tuple(out) or (1,)


def test_pages_tiled_two_ways_are_compared_element_by_element() -> None:
    """Two views whose blocks hold one dense page each, the page shaped otherwise in each (AITER's K
    [H, C/x, N, x] and V [H, N/x, C, x]), interleaved in one buffer: share_elements is exact, since
    each view's dims coalesce to (block, page) before they are compared."""
    from kvgen.runtime.aliasing import extent, share_elements

    rng = random.Random(23)
    buf = torch.zeros(1 << 14, dtype=torch.int16)
    for _ in range(500):
        page = rng.choice([4, 6, 8, 12, 16, 32])
        blocks, step = rng.randint(1, 5), page * rng.randint(1, 3)
        views, elements = [], []
        for _side in range(2):
            base = rng.randint(0, 3 * page)
            inner = _factors(page, rng)
            dense = [1]
            for n in reversed(inner[1:]):
                dense.insert(0, dense[0] * n)
            views.append(buf.as_strided((blocks, *inner), (step, *dense), base))
            elements.append({base + b * step + i for b in range(blocks) for i in range(page)})
        assert share_elements(extent(views[0]), extent(views[1])) == bool(elements[0] & elements[1])
