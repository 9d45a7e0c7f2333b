"""Streams, synchronization and staging, proven on CPU with a recording fake backend
(and for real by the connector tests wherever CUDA or XPU is present)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from code_rules import source_nodes
from harness import (
    EXT,
    SCENARIOS,
    block_table_mapping,
    builtin_library,
    clone_tree,
    connector_store,
    make_cache,
    make_objects,
    reference_load,
    reference_store,
    same_bits,
)

from kvgen import generated
from kvgen.runtime import KVLayoutError, backend_for
from kvgen.runtime.devices import CpuBackend

LIB = builtin_library()


class RecordingBackend(CpuBackend):
    """CPU semantics, but every stream operation and staged copy is written down."""

    name = "recording"

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.current = "main"
        self.count = 0

    def new_stream(self) -> str:
        self.count += 1
        return f"stream{self.count}"

    def current_stream(self) -> str:
        return self.current

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def wait_stream(self, waiter: Any, stream: Any) -> None:
        self.events.append(("wait", waiter, stream))

    def synchronize(self, stream: Any) -> None:
        self.events.append(("sync", stream))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.events.append(("copy", self.current))
        dst.copy_(src)


def _layerwise(backend: RecordingBackend, use_gpu: bool = True) -> tuple[Any, Any, torch.Tensor]:
    conn = generated.get("vllm_flash_attn_nhd", "kv_t2d")(backend=backend, use_gpu=use_gpu)
    cache = make_cache(LIB["vllm_flash_attn_nhd"], torch.float32, "cpu")
    conn.bind(cache)
    return conn, cache, torch.tensor(block_table_mapping(16, random.Random(1), EXT))


@pytest.mark.parametrize("sync", [True, False])
def test_layerwise_store_stream_order(sync: bool) -> None:
    backend = RecordingBackend()
    conn, cache, mapping = _layerwise(backend)
    objs = make_objects(conn, [16], torch.float32, "cpu", salt=1)
    per_layer = [[chunk[layer] for chunk in objs] for layer in range(EXT["L"])]
    gen = conn.batched_from_gpu(per_layer, [0], [16], kvcaches=cache, slot_mapping=mapping, sync=sync)
    for _layer in range(EXT["L"]):
        next(gen)
        # each layer: the store stream first waits for the compute stream, then copies on it
        assert backend.events[-2:] == [("wait", "stream1", "main"), ("copy", "stream1")]
    next(gen)
    assert backend.events[-1] == (("sync", "stream1") if sync else ("wait", "main", "stream1"))
    with pytest.raises(StopIteration):
        next(gen)


@pytest.mark.parametrize("sync", [True, False])
def test_layerwise_load_stream_order(sync: bool) -> None:
    backend = RecordingBackend()
    conn, cache, mapping = _layerwise(backend)
    objs = make_objects(conn, [16], torch.float32, "cpu", salt=1, fmt=conn.format)
    gen = conn.batched_to_gpu([0], [16], kvcaches=cache, slot_mapping=mapping, sync=sync)
    next(gen)
    assert backend.events == []  # priming moves nothing
    for layer in range(EXT["L"]):
        gen.send([objs[0][layer]])
        want = [("wait", "stream1", "main"), ("copy", "stream1")]
        if sync:  # the compute stream may not read layer l before its load is done
            want.append(("wait", "main", "stream1"))
        assert backend.events[-len(want):] == want
    next(gen)
    assert backend.events[-1] == (("sync", "stream1") if sync else ("wait", "main", "stream1"))


def test_whole_connector_synchronizes_current_stream() -> None:
    backend = RecordingBackend()
    conn = generated.get("vllm_flash_attn_nhd", "kv_2ltd")(backend=backend)
    cache = make_cache(LIB["vllm_flash_attn_nhd"], torch.float32, "cpu")
    conn.bind(cache)
    obj = make_objects(conn, [8], torch.float32, "cpu", salt=2)[0]
    conn.from_gpu(obj, 0, 8, kvcaches=cache, slot_mapping=torch.arange(8))
    assert backend.events == [("sync", "main")]


@pytest.mark.parametrize("sync", [True, False])
def test_interleaved_store_and_load_generators(sync: bool) -> None:
    """A store of one cache and a load of another, stepped alternately, both exact."""
    paged, obj = LIB["vllm_flashinfer_hnd"], LIB["kv_2td"]
    sc = SCENARIOS["noncontiguous_chunks"]
    mapping_list = sc.mapping(random.Random(3), EXT)
    mapping = torch.tensor(mapping_list)
    conn = generated.get(paged.name, obj.name)()
    src, dst = make_cache(paged, torch.float32, "cpu"), make_cache(paged, torch.float32, "cpu")
    conn.bind(src)
    lengths = [e - s for s, e in zip(sc.starts, sc.ends, strict=True)]
    stored = make_objects(conn, lengths, torch.float32, "cpu", salt=4)
    want_stored = make_objects(conn, lengths, torch.float32, "cpu", salt=4)
    loaded = make_objects(conn, lengths, torch.float32, "cpu", salt=900, fmt=conn.format)
    want_dst = clone_tree(dst)

    store = conn.batched_from_gpu([[c[layer] for c in stored] for layer in range(EXT["L"])], sc.starts, sc.ends,
                                  kvcaches=src, slot_mapping=mapping, sync=sync)
    load = conn.batched_to_gpu(sc.starts, sc.ends, kvcaches=dst, slot_mapping=mapping, sync=sync)
    next(load)
    for layer in range(EXT["L"]):
        next(store)
        load.send([c[layer] for c in loaded])
    next(store)
    next(load)

    reference_store(paged, obj, src, want_stored, sc, mapping_list)
    reference_load(paged, obj, want_dst, loaded, sc, mapping_list)
    assert same_bits([[o.tensor for o in c] for c in stored], [[o.tensor for o in c] for c in want_stored])
    assert same_bits(dst, want_dst)


@pytest.mark.parametrize("module", ["vllm_flash_attn_hnd__kv_2ltd", "sglang_mha__kv_t2d"])
def test_staging_buffer_matches_direct_copy(module: str) -> None:
    """use_gpu gathers into one staging tensor first; the result is the same, -1 tokens
    included (they keep the object's bytes)."""
    paged, obj = module.split("__")
    sc = SCENARIOS["minus1_prefix"]
    mapping = torch.tensor(sc.mapping(random.Random(5), EXT))
    results = []
    for use_gpu in (False, True):
        conn = generated.get(paged, obj)(use_gpu=use_gpu)
        cache = make_cache(LIB[paged], torch.float32, "cpu")
        conn.bind(cache)
        objs = make_objects(conn, [16], torch.float32, "cpu", salt=6)
        connector_store(conn, objs, sc, cache, mapping)
        results.append(objs)
    tensors = [[o.tensor for o in (c if isinstance(c, list) else [c])] for r in results for c in r]
    assert same_bits(tensors[0], tensors[1])


def test_staging_cap_refuses_before_writing() -> None:
    conn = generated.get("vllm_flash_attn_nhd", "kv_2ltd")(use_gpu=True, staging_bytes=1024)
    cache = make_cache(LIB["vllm_flash_attn_nhd"], torch.float32, "cpu")
    conn.bind(cache)
    obj = make_objects(conn, [16], torch.float32, "cpu", salt=8)[0]
    before_obj, before_cache = obj.tensor.clone(), clone_tree(cache)
    need = obj.tensor.numel() * 4
    with pytest.raises(KVLayoutError, match=f"a chunk needs {need} bytes, 1024 bytes are available"):
        conn.from_gpu(obj, 0, 16, kvcaches=cache, slot_mapping=torch.arange(16))
    assert torch.equal(obj.tensor, before_obj) and same_bits(cache, before_cache)
    assert obj.metadata.fmt is None


def test_backends_by_device_type() -> None:
    assert backend_for("cpu").name == "cpu"
    assert backend_for("cuda").name == "cuda"  # constructing needs no device
    assert backend_for("xpu").name == "xpu"
    with pytest.raises(KVLayoutError, match="known: cpu, cuda, xpu"):
        backend_for("meta")


def test_recording_backend_with_a_device_and_threads() -> None:
    """A backend passed in serves every call, and per-thread staging keeps two threads'
    staged stores apart on it (each result checked against the reference)."""
    import threading

    paged, obj = LIB["vllm_flash_attn_nhd"], LIB["kv_2ltd"]
    backend = RecordingBackend()
    conn = generated.get(paged.name, obj.name)(device="cpu", backend=backend, use_gpu=True)
    sc = SCENARIOS["partial_blocks"]
    mapping_list = sc.mapping(random.Random(9), EXT)
    cache = make_cache(paged, torch.float32, "cpu")
    lengths = [e - s for s, e in zip(sc.starts, sc.ends, strict=True)]
    conn.bind(cache)
    want = make_objects(conn, lengths, torch.float32, "cpu", salt=12)
    reference_store(paged, obj, cache, want, sc, mapping_list)
    results: list[bool] = []

    def work() -> None:
        for _ in range(20):
            got = make_objects(conn, lengths, torch.float32, "cpu", salt=12)
            connector_store(conn, got, sc, cache, torch.tensor(mapping_list))
            results.append(same_bits([o.tensor for o in got], [o.tensor for o in want]))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 40
    assert ("copy", "main") in backend.events and ("sync", "main") in backend.events


def test_generated_code_talks_to_devices_only_through_the_runtime() -> None:
    """One connector serves every device: no generated module names a device API."""
    import ast
    from pathlib import Path

    folder = Path(generated.__file__).parent
    for path in folder.glob("*.py"):
        nodes = source_nodes(path)
        imports = {alias.name for node in nodes if isinstance(node, ast.Import) for alias in node.names}
        imports |= {node.module for node in nodes if isinstance(node, ast.ImportFrom) and node.module}
        allowed = {"__future__", "enum", "importlib", "typing", "collections.abc", "torch", "kvgen"}
        if path.stem.endswith("_triton"):  # a kernel: one Triton source for every GPU backend
            allowed |= {"triton", "triton.language", "kvgen.runtime", "kvgen.runtime.tiles"}
        assert imports <= allowed, path
        attrs = {node.attr for node in nodes if isinstance(node, ast.Attribute)
                 and isinstance(node.value, ast.Name) and node.value.id == "torch"}
        assert not attrs & {"cuda", "xpu", "mps"}, f"{path.name} uses torch.{attrs & {'cuda', 'xpu', 'mps'}}"


def test_layerwise_connector_points_whole_calls_at_the_generators() -> None:
    conn = generated.get("vllm_flash_attn_nhd", "kv_t2d")()
    with pytest.raises(TypeError, match=r"use the generator batched_from_gpu\(memory_objs\[layer\]\[chunk\]"):
        conn.from_gpu(None, 0, 1)
    with pytest.raises(TypeError, match=r"use the generator batched_to_gpu\(starts, ends, \.\.\.\) and send\(\)"):
        conn.to_gpu(None, 0, 1)
