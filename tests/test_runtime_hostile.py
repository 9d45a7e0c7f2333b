"""Hostile inputs an audit found (issue 20): memory that is not what its view says (storage
shrunk after the view was made, a layer freed between two steps of a layerwise transfer, a
lazy negation), slot and chunk values that would wrap or be truncated, and batches that
could be refused half-way. Each is refused by kvgen's own error before the first write, on
every copy path (torch ops, the compiled CPU kernel, Triton's interpreter).

A tensor whose storage was shrunk must not be read again (its view reaches past its memory),
so the refusals below compare only the other tensors with their state before the call.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from test_runtime_safety import (
    ENDS,
    LAYERWISE,
    LIB,
    NHD,
    SMALL,
    STARTS,
    WHOLE,
    build_cache,
    check_load,
    check_store,
    make_objs,
    mapping_for,
    nothing_written,
    run_load,
    run_store,
)

from kvgen import generated
from kvgen.oracle import reference
from kvgen.runtime import KVLayoutError, MemoryObj, available_devices, native
from kvgen.runtime.aliasing import check_plain

HAVE_TRITON = importlib.util.find_spec("triton") is not None
if HAVE_TRITON and available_devices() == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # kernel modules are imported on first use
#: Every copy path a CPU cache can take; one that cannot run here is skipped, never replaced.
BACKENDS = ["torch", "native", "triton"]
LENGTHS = [e - s for s, e in zip(STARTS, ENDS, strict=True)]


def path_connector(obj: str, backend: str) -> Any:
    if backend == "native" and native.unavailable():
        pytest.skip(f"no compiled kernel here: {native.unavailable()}")
    if backend == "triton" and not HAVE_TRITON:
        pytest.skip("triton is not installed")
    return generated.get(NHD, obj)(device="cpu", backend=backend)


def shrink(t: torch.Tensor, nbytes: int = 16) -> None:
    """What an engine's sleep mode does to a cache it frees: the storage under the view shrinks."""
    t.untyped_storage().resize_(nbytes)


def mapping() -> torch.Tensor:
    return torch.tensor(mapping_for(SMALL, ENDS[-1], 1))


# -- 1. storage smaller than the view ----------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("obj", [WHOLE, LAYERWISE])
@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("bound", [False, True], ids=["fresh", "bound_before"])
def test_cache_leaf_with_shrunk_storage_is_refused(backend: str, obj: str, direction: str, bound: bool) -> None:
    """Layer 1's storage shrinks to 16 bytes (after a transfer bound the cache, or before the
    first): refused by name before anything moves; the other layers and objects keep their bits."""
    conn = path_connector(obj, backend)
    cache = build_cache(SMALL, torch.float32)
    objs = make_objs(conn, cache, LENGTHS, 9, conn.format if direction == "load" else None)
    if bound:
        check_store(conn, obj, SMALL, cache)
    shrink(cache[1])
    others = [cache[0], cache[2]]
    with nothing_written(others, objs), pytest.raises(
            KVLayoutError, match=r"kvcaches\[1\].* storage holds 16 bytes, but the view reaches \d+"):
        (run_store if direction == "store" else run_load)(conn, objs, cache, mapping())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("obj", [WHOLE, LAYERWISE])
@pytest.mark.parametrize("direction", ["store", "load"])
def test_object_with_shrunk_storage_is_refused(backend: str, obj: str, direction: str) -> None:
    """The last chunk's object (its last layer's, when layerwise) has lost its storage: the
    batch is refused before chunk 0 moves."""
    conn = path_connector(obj, backend)
    cache = build_cache(SMALL, torch.float32)
    objs = make_objs(conn, cache, LENGTHS, 9, conn.format if direction == "load" else None)
    victim = objs[-1][-1] if obj == LAYERWISE else objs[-1]
    shrink(victim.tensor)
    kept = objs[:-1]
    name = r"for layer 2, chunk 1" if obj == LAYERWISE else r"for chunk 1"
    if obj == LAYERWISE and direction == "load":  # objects arrive per layer: layers 0 and 1 are loaded
        name = r"for layer 2, chunk 1"
    with nothing_written(cache if direction == "store" or obj == WHOLE else [], kept), pytest.raises(
            KVLayoutError, match=rf"memory object {name}: its storage holds 16 bytes, but the view reaches \d+"):
        (run_store if direction == "store" else run_load)(conn, objs, cache, mapping())


def test_a_cache_regrown_to_its_size_moves_again() -> None:
    """Storage shrunk, then grown back (a woken engine): the cache is checked again and moves."""
    conn = path_connector(WHOLE, "torch")
    cache = build_cache(SMALL, torch.float32)
    check_store(conn, WHOLE, SMALL, cache)
    size = cache[1].untyped_storage().nbytes()
    shrink(cache[1])
    with pytest.raises(KVLayoutError, match="storage holds 16 bytes"):
        conn.bind(cache)
    cache[1].untyped_storage().resize_(size)
    cache[1].copy_(build_cache(SMALL, torch.float32)[1])  # its codes again
    check_store(conn, WHOLE, SMALL, cache)
    check_load(conn, WHOLE, SMALL, cache)


# -- 2. a layer freed between two steps of a layerwise transfer --------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_freed_during_a_layerwise_store_stops_it(backend: str) -> None:
    """Layer 0 is stored, then layer 1's storage is freed: the next step is refused and
    layer 1's objects stay as they were."""
    conn = path_connector(LAYERWISE, backend)
    cache = build_cache(SMALL, torch.float32)
    objs = make_objs(conn, cache, LENGTHS, 9)
    per_layer = [[c[layer] for c in objs] for layer in range(SMALL["L"])]
    gen = conn.batched_from_gpu(per_layer, STARTS, ENDS, kvcaches=cache, slot_mapping=mapping())
    next(gen)
    shrink(cache[1])
    with nothing_written(per_layer[1], per_layer[2]), pytest.raises(
            KVLayoutError, match=r"layer 1: cache tensor kvcaches\[1\]: its storage holds 16 bytes.*layers before"):
        next(gen)


@pytest.mark.parametrize("backend", BACKENDS)
def test_object_freed_during_a_layerwise_store_stops_it(backend: str) -> None:
    """Layer 2's object of chunk 0 loses its storage while layer 1 is stored: layer 2 is refused."""
    conn = path_connector(LAYERWISE, backend)
    cache = build_cache(SMALL, torch.float32)
    objs = make_objs(conn, cache, LENGTHS, 9)
    per_layer = [[c[layer] for c in objs] for layer in range(SMALL["L"])]
    gen = conn.batched_from_gpu(per_layer, STARTS, ENDS, kvcaches=cache, slot_mapping=mapping())
    next(gen)
    next(gen)
    shrink(per_layer[2][0].tensor)
    with nothing_written(cache, per_layer[2][1]), pytest.raises(
            KVLayoutError, match=r"layer 2: memory object for chunk 0: its storage holds 16 bytes"):
        next(gen)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["shrunk", "moved"])
def test_layer_freed_during_a_layerwise_load_stops_it(backend: str, how: str) -> None:
    """Layer 1's memory is freed after layer 0 was loaded (or, "moved", the tensor is given
    new memory of its full size elsewhere): its objects are refused, nothing is written to
    freed memory or to the other layers."""
    conn = path_connector(LAYERWISE, backend)
    cache = build_cache(SMALL, torch.float32)
    objs = make_objs(conn, cache, LENGTHS, 9, conn.format)
    gen = conn.batched_to_gpu(STARTS, ENDS, kvcaches=cache, slot_mapping=mapping())
    next(gen)
    gen.send([c[0] for c in objs])
    leaf = cache[1]
    if how == "shrunk":
        shrink(leaf)
    else:
        leaf.set_(torch.zeros_like(leaf).untyped_storage(), 0, leaf.shape, leaf.stride())
    refusal = "storage holds 16 bytes" if how == "shrunk" else "moved in memory since the transfer started"
    with nothing_written([cache[0], cache[2]], objs), pytest.raises(
            KVLayoutError, match=rf"layer 1: cache tensor kvcaches\[1\]: .*{refusal}"):
        gen.send([c[1] for c in objs])


def test_layerwise_store_of_a_cache_with_layers_in_one_tensor_checks_it_per_layer() -> None:
    """A stacked cache (L inside one tensor): the one leaf is checked before every layer."""
    conn = generated.get("trtllm_pool", LAYERWISE)(device="cpu", backend="torch")
    spec = LIB["trtllm_pool"]
    cache = reference.layouts.nest(spec, SMALL, lambda path: torch.zeros(reference.layouts.leaf_shape(spec, SMALL)))
    g = conn.bind(cache)
    objs = [[MemoryObj(torch.zeros(conn.get_shape(n))) for n in LENGTHS] for _ in range(g.L)]
    gen = conn.batched_from_gpu(objs, STARTS, ENDS, kvcaches=cache, slot_mapping=mapping())
    next(gen)
    shrink(cache)
    with nothing_written(objs[1:]), pytest.raises(KVLayoutError,
                                                  match=r"layer 1: cache tensor kvcaches: its storage holds 16 bytes"):
        next(gen)


# -- 7. lazily negated views -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("bound", [False, True], ids=["fresh", "bound_before"])
def test_a_negated_view_as_cache_tensor_is_refused(backend: str, direction: str, bound: bool) -> None:
    """torch._neg_view(x) shares x's bytes and negates on read: copied as bytes its sign
    would be lost. Refused (also right after x itself was bound: same address, same strides)."""
    conn = path_connector(WHOLE, backend)
    cache = build_cache(SMALL, torch.float32)
    objs = make_objs(conn, cache, LENGTHS, 9, conn.format if direction == "load" else None)
    if bound:
        check_store(conn, WHOLE, SMALL, cache)
    cache[1] = torch._neg_view(cache[1])
    with nothing_written(cache, objs), pytest.raises(
            KVLayoutError, match=r"cache tensor kvcaches\[1\] is a negated view .*resolve_neg\(\)"):
        (run_store if direction == "store" else run_load)(conn, objs, cache, mapping())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("obj", [WHOLE, LAYERWISE])
@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_negated_view_as_object_is_refused(backend: str, obj: str, direction: str) -> None:
    conn = path_connector(obj, backend)
    cache = build_cache(SMALL, torch.float32)
    objs = make_objs(conn, cache, LENGTHS, 9, conn.format if direction == "load" else None)
    fmt = conn.format if direction == "load" else None
    if obj == LAYERWISE:
        objs[1][0] = MemoryObj(torch._neg_view(objs[1][0].tensor), fmt)
        name = "for layer 0, chunk 1"
    else:
        objs[1] = MemoryObj(torch._neg_view(objs[1].tensor), fmt)
        name = "for chunk 1"
    with nothing_written(cache, objs), pytest.raises(
            KVLayoutError, match=rf"memory object {name} is a negated view .*resolve_neg\(\)"):
        (run_store if direction == "store" else run_load)(conn, objs, cache, mapping())


def test_a_conjugated_view_is_refused_like_a_negated_one() -> None:
    """No cache dtype is complex today; the check that refuses a lazy negation refuses a lazy
    conjugation too, so that a copy of bytes never drops one."""
    lazy = torch.tensor([1 + 2j, 3 - 4j]).conj()
    with pytest.raises(KVLayoutError, match=r"x is a conjugated view .*resolve_conj\(\)"):
        check_plain(lazy, "x")
    check_plain(lazy.resolve_conj(), "x")


# -- 10. half-written batches -------------------------------------------------------------------------


@dataclass(frozen=True)
class FrozenMetadata:
    fmt: Any = None


@dataclass
class ReadOnlyLabel:
    """A memory object whose label a store cannot set after it wrote the tensor."""

    tensor: torch.Tensor
    metadata: FrozenMetadata = field(default_factory=FrozenMetadata)


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("obj", [WHOLE, LAYERWISE])
def test_a_store_into_an_object_whose_label_cannot_be_set_writes_nothing(backend: str, obj: str) -> None:
    """Chunk 1's (last layer's) object has a frozen label: chunk 0 was written, then a raw
    AttributeError came; now the batch is refused before the first write."""
    conn = path_connector(obj, backend)
    cache = build_cache(SMALL, torch.float32)
    objs = make_objs(conn, cache, LENGTHS, 9)
    if obj == LAYERWISE:
        objs[1][-1] = ReadOnlyLabel(objs[1][-1].tensor)
    else:
        objs[1] = ReadOnlyLabel(objs[1].tensor)
    with nothing_written(cache, objs), pytest.raises(
            KVLayoutError, match=r"memory object .*: its format label \(.metadata.fmt\) cannot be set"):
        run_store(conn, objs, cache, mapping())
