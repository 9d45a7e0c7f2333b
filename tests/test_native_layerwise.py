"""Layerwise connectors on the compiled CPU kernel: each layer is one kernel call with the
threads and streaming its call chose once (reading the host's load is not repeated per
layer), leaves the kernel cannot describe still fall back to torch layer by layer, and
backend='native' refuses them before any write."""

from __future__ import annotations

import random

import pytest
import torch
from harness import EXT, SCENARIOS, builtin_library, make_cache

from kvgen import generated
from kvgen.errors import KVLayoutError
from kvgen.oracle.scenarios import connector_load, connector_store, make_objects
from kvgen.runtime import native
from kvgen.runtime.movers import native as native_mover
from kvgen.runtime.movers import torch as torch_mover

LIBRARY = builtin_library()
NHD, KV_2TD = LIBRARY["vllm_flash_attn_nhd"], LIBRARY["kv_2td"]
SC = SCENARIOS["partial_blocks"]

pytestmark = pytest.mark.skipif(bool(native.unavailable()), reason=f"no compiled kernel: {native.unavailable()}")


def _setup(backend: str | None, mixed: bool = False):  # noqa: ANN202
    cache = make_cache(NHD, torch.float32, "cpu")
    if mixed:  # layer 1 with other strides: no single description serves every layer
        cache[1] = make_cache(NHD, torch.float32, "cpu", strided=True)[1]
    mapping = torch.tensor(SC.mapping(random.Random(1), EXT), dtype=torch.long)
    lengths = [e - s for s, e in zip(SC.starts, SC.ends, strict=True)]
    c = generated.get(NHD.name, KV_2TD.name)(device="cpu", backend=backend)
    c.bind(cache)
    return c, cache, mapping, make_objects(c, lengths, torch.float32, "cpu", salt=3)


@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_layerwise_call_picks_its_threads_once(direction: str, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []

    def counting(nbytes: int, *args: int) -> int:
        asked.append(nbytes)
        return 1

    for module in (native_mover, torch_mover):
        monkeypatch.setattr(module, "cpu_threads", counting)
    c, cache, mapping, objs = _setup(None)
    calls = native.stats["calls"]
    if direction == "store":
        connector_store(c, objs, SC, cache, mapping)
    else:
        connector_store(c, objs, SC, cache, mapping)
        asked.clear()
        connector_load(c, objs, SC, cache, mapping)
    assert native.stats["calls"] > calls
    sizes = {o[0].tensor.numel() * o[0].tensor.element_size() for o in objs}  # one per object size
    assert EXT["L"] > 1 and len(asked) == len(sizes)


@pytest.mark.parametrize("direction", ["store", "load"])
def test_leaves_the_kernel_cannot_describe_fall_back_layer_by_layer(direction: str) -> None:
    got = {}
    for backend in (None, "torch"):
        c, cache, mapping, objs = _setup(backend, mixed=True)
        fallbacks = native.stats["fallbacks"]
        connector_store(c, objs, SC, cache, mapping)
        if direction == "load":
            cache = make_cache(NHD, torch.float32, "cpu")  # other values, same geometry
            cache[1] = make_cache(NHD, torch.float32, "cpu", strided=True)[1]
            c.bind(cache)
            connector_load(c, objs, SC, cache, mapping)
            got[backend] = [t.clone() for t in cache]
        else:
            got[backend] = [t.tensor.clone() for chunk in objs for t in chunk]
        if backend is None:
            assert native.stats["fallbacks"] > fallbacks
    assert all(torch.equal(a, b) for a, b in zip(got[None], got["torch"], strict=True))


def test_a_forced_kernel_refuses_them_before_any_write() -> None:
    c, cache, mapping, objs = _setup("native", mixed=True)
    before = [t.tensor.clone() for chunk in objs for t in chunk]
    with pytest.raises(KVLayoutError, match="backend='native' cannot move this cache: .*strides"):
        connector_store(c, objs, SC, cache, mapping)
    assert all(torch.equal(t.tensor, b) for t, b in zip([t for ch in objs for t in ch], before, strict=True))
