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
from typing import Any

import pytest
import torch
from test_runtime_safety import (
    ENDS,
    LAYERWISE,
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
from kvgen.runtime import KVLayoutError, available_devices, native

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
