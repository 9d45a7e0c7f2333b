"""The movers execute the planner's description: PROGRAM in the generated module decides what
every mover moves (the compiled CPU kernel, the torch ops, the Triton kernel) and whether the
compiled kernel moves a connector at all. A copy of a generated module with PROGRAM altered
(and nothing else; its Triton twin copied unchanged) makes each mover move other bytes, in the
way the alteration says; and no mover imports the spec or the planner, or reads the layout
facts, so none re-plans at run time.

Every cache value is its own flat position in the cache, so a K/V or layer swap, a transposition
or a lost token shows."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import builtin_library

import kvgen
from kvgen import generated
from kvgen.errors import KVLayoutError
from kvgen.oracle.scenarios import EXT, make_cache
from kvgen.oracle.scenarios.transfers import DST_EXT, SRC_EXT
from kvgen.oracle.scenarios.transfers import make_cache as make_transfer_cache
from kvgen.runtime import MemoryObj, devices, kernels, native
from kvgen.runtime.connector import max_word
from kvgen.runtime.movers import native as native_mover
from kvgen.runtime.movers.choose import choose

pytestmark = pytest.mark.skipif(bool(native.unavailable()), reason=f"no compiled kernel: {native.unavailable()}")

if importlib.util.find_spec("triton") is not None and devices.available_devices() == ["cpu"]:
    # Kernel modules are imported on first use, after collection: they see the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

LIBRARY_SPECS = builtin_library()
MODULE = "vllm_flash_attn_nhd__kv_2ltd"  # cache L x [KV B N H C], object [KV L T (H C)]
#: Two layers and K/V, so that swapping the object's KV and L places keeps every address inside it.
L, KV, B, N, H, C = 2, 2, 6, 4, 2, 3
#: Tokens 0-9 at slots 2..11: a partial block (the token path), then blocks 1 and 2 whole (the block path).
MAPPING = torch.arange(2, 12)


def _altered(tmp_path: Path, old: str, new: str, module: str = MODULE) -> Any:
    """The Connector of a copy of `module` whose text has `old` (found once) replaced by `new`;
    its Triton twin is copied unchanged next to it, where the Triton mover finds it."""
    here = Path(generated.__file__).parent
    text = (here / f"{module}.py").read_text()
    assert text.count(old) == 1, old
    name = f"altered_{tmp_path.name}_{module}"  # a module name of its own per test
    path = tmp_path / f"{name}.py"
    path.write_text(text.replace(old, new))
    shutil.copy(here / f"{module}_triton.py", tmp_path / f"{name}_triton.py")
    if str(tmp_path) not in sys.path:
        sys.path.insert(0, str(tmp_path))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.Connector


def _mover_here(backend: str) -> None:
    why = kernels.unavailable(torch.device("cpu")) if backend == "triton" else None
    if why:
        pytest.skip(why)


def _cache() -> list[torch.Tensor]:
    per = KV * B * N * H * C
    return [(torch.arange(per, dtype=torch.float32) + layer * per).view(KV, B, N, H, C) for layer in range(L)]


def _store(cls: Any, backend: str | None) -> torch.Tensor:
    c = cls(device="cpu", backend=backend)
    cache = _cache()
    o = torch.full(tuple(c.get_shape(len(MAPPING), cache)), -1.0)
    c.from_gpu(MemoryObj(o), 0, len(MAPPING), kvcaches=cache, slot_mapping=MAPPING)
    return o


SWAP_OLD = "    object_places=(\n        ('KV', 0, ()),\n        ('L', 1, ()),\n"
SWAP_NEW = "    object_places=(\n        ('KV', 1, ()),\n        ('L', 0, ()),\n"


@pytest.mark.parametrize("backend", ["native", "torch", "triton"])
def test_the_object_places_of_program_decide_where_every_mover_writes(tmp_path: Path, backend: str) -> None:
    """PROGRAM with the object's KV and L places swapped: every mover writes layer l's K or V
    where the object's [kv=l, layer=kv] entry is, which is the reference object transposed."""
    _mover_here(backend)
    plain = generated.get("vllm_flash_attn_nhd", "kv_2ltd")
    reference = _store(plain, "torch")
    assert torch.equal(_store(plain, backend), reference)
    cls = _altered(tmp_path, SWAP_OLD, SWAP_NEW)
    assert cls(device="cpu", backend=backend).copy_backend_for("cpu") == backend
    altered = _store(cls, backend)
    assert not torch.equal(altered, reference)
    assert torch.equal(altered, reference.transpose(0, 1))


@pytest.mark.parametrize("backend", ["native", "torch", "triton"])
def test_loading_through_an_altered_program_reads_the_places_it_names(tmp_path: Path, backend: str) -> None:
    """The load direction follows the same places on every mover: the transposed object loaded
    through the swapped PROGRAM puts every moved slot back as it was in the cache."""
    _mover_here(backend)
    reference = _store(generated.get("vllm_flash_attn_nhd", "kv_2ltd"), "torch")
    cls = _altered(tmp_path, SWAP_OLD, SWAP_NEW)
    c = cls(device="cpu", backend=backend)
    target = [torch.zeros(KV, B, N, H, C) for _ in range(L)]
    c.to_gpu(MemoryObj(reference.transpose(0, 1).contiguous(), c.format), 0, len(MAPPING), kvcaches=target,
             slot_mapping=MAPPING)
    moved = torch.zeros(B * N, dtype=torch.bool)
    moved[MAPPING] = True
    for layer, (got, want) in enumerate(zip(target, _cache(), strict=True)):
        got, want = got.view(KV, B * N, H, C), want.view(KV, B * N, H, C)
        assert torch.equal(got[:, moved], want[:, moved]), layer
        assert not got[:, ~moved].any(), layer


#: The cache's N and H places swapped: an NHD leaf read as HND.
HN_OLD = "('N', 2, ()), ('H', 3, ())"
HN_NEW = "('N', 3, ()), ('H', 2, ())"


@pytest.mark.parametrize("backend", ["native", "torch", "triton"])
def test_the_cache_places_of_program_decide_where_every_mover_reads(tmp_path: Path, backend: str) -> None:
    """PROGRAM with the cache's N and H places swapped (blocks of 4 slots by 4 heads): every
    mover reads slot n's head h where the cache holds slot h's head n, so each whole block of
    the object comes out with its tokens and heads transposed."""
    _mover_here(backend)
    heads = N
    per = KV * B * N * heads * C
    cache = [(torch.arange(per, dtype=torch.float32) + layer * per).view(KV, B, N, heads, C) for layer in range(L)]
    mapping = torch.arange(N, 3 * N)  # blocks 1 and 2, whole

    def store(cls: Any) -> torch.Tensor:
        c = cls(device="cpu", backend=backend)
        o = torch.full(tuple(c.get_shape(len(mapping), cache)), -1.0)
        c.from_gpu(MemoryObj(o), 0, len(mapping), kvcaches=cache, slot_mapping=mapping)
        return o.view(KV, L, 2, N, heads, C)

    reference = store(generated.get("vllm_flash_attn_nhd", "kv_2ltd"))
    altered = store(_altered(tmp_path, HN_OLD, HN_NEW))
    assert not torch.equal(altered, reference)
    assert torch.equal(altered, reference.transpose(3, 4))


#: The source files of everything that moves a chunk: the movers, the Triton launcher and tile
#: mover, the compiled kernel's loader, and the torch helpers the generated copies call.
RUNTIME = Path(kvgen.__file__).parent / "runtime"
MOVER_SOURCES = (*sorted((RUNTIME / "movers").glob("*.py")),
                 *(RUNTIME / f for f in ("kernels.py", "tiles.py", "ops.py", "native.py")))


def _layout_reads(path: Path) -> list[str]:
    """Where `path` imports the spec, the planner or the oracle, names PagedLayout or
    ObjectLayout, or reads a `layout` or `memory` attribute (a connector's layout facts)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom | ast.Import):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found += [f"{path.name}:{node.lineno}: imports {n}" for n in names
                      if n.startswith(("kvgen.spec", "kvgen.plan", "kvgen.oracle"))]
            if isinstance(node, ast.ImportFrom) and node.module == "kvgen.runtime.layout":
                found += [f"{path.name}:{node.lineno}: imports {a.name} of kvgen.runtime.layout"
                          for a in node.names if a.name != "Geometry"]
        elif isinstance(node, ast.Name) and node.id in ("PagedLayout", "ObjectLayout"):
            found.append(f"{path.name}:{node.lineno}: names {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in ("layout", "memory", "PagedLayout", "ObjectLayout"):
            found.append(f"{path.name}:{node.lineno}: reads .{node.attr}")
    return found


def test_no_mover_imports_the_planner_or_reads_the_layout_facts() -> None:
    """What a mover decides comes from PROGRAM (and the Triton twin's KernelSpec) and the live
    tensors: no mover imports kvgen.spec, kvgen.plan or kvgen.oracle, none names PagedLayout or
    ObjectLayout, and none reads a connector's `layout` or `memory`, so none can re-plan from
    the layout facts at run time."""
    assert len(MOVER_SOURCES) == 11 and all(p.is_file() for p in MOVER_SOURCES)
    found = [line for path in MOVER_SOURCES for line in _layout_reads(path)]
    assert not found, "\n".join(found)


def test_the_layout_read_check_finds_each_kind_of_read(tmp_path: Path) -> None:
    """The check above is not blind: each kind of read it forbids, in a source of its own, is found."""
    source = tmp_path / "mover.py"
    source.write_text("from kvgen.plan.copy import Mode\nimport kvgen.spec.model\n"
                      "from kvgen.runtime.layout import Geometry, PagedLayout\n"
                      "def f(c):\n    return c.layout, c.memory, PagedLayout\n")
    assert [line.split(": ", 1)[1] for line in _layout_reads(source)] == [
        "imports kvgen.plan.copy", "imports kvgen.spec.model", "imports PagedLayout of kvgen.runtime.layout",
        "reads .layout", "reads .memory", "names PagedLayout"]


def test_the_run_merge_is_the_plans(tmp_path: Path) -> None:
    """The plan lets N, H and C of an NHD block merge into one run (the block's tokens are
    adjacent on both sides); a PROGRAM that lets nothing merge makes the kernel copy one
    element per run, with the same bytes moved."""
    plain = generated.get("vllm_flash_attn_nhd", "kv_2ltd")
    blocks = plain.program.path("blocks")
    assert blocks is not None and blocks.store_run == ("N", "H", "C")
    old = "            store_run=('N', 'H', 'C'),\n"
    cls = _altered(tmp_path, old, "            store_run=(),\n")
    runs: dict[str, list[int]] = {}
    real = native_mover.describe

    def spy(program: Any, store: bool, *args: Any) -> Any:
        found = real(program, store, *args)
        runs.setdefault("altered" if program is cls.program else "plain", []).extend(c.run for c in found.calls)
        return found

    native_mover.describe, saved = spy, native_mover.describe
    try:
        assert torch.equal(_store(cls, "native"), _store(plain, "native"))
    finally:
        native_mover.describe = saved
    item = torch.float32.itemsize
    assert runs["plain"][0] == N * H * C * item  # a whole block per run
    assert runs["altered"][0] == item


def test_an_axis_the_spec_fixes_at_one_never_splits_a_run() -> None:
    """A [B, H, N, C] block whose spec fixes H at 1 (DeepSeek-V4's indexer keys) has each plane's
    tokens of a block adjacent, so the plan lets N and C merge into one run, and the kernel copies
    a block's plane at once; where H is free (vLLM's HND), H stands between N and C and only C is
    the run. The bytes moved are the reference's (test_native, test_planes_connectors)."""
    indexer = generated.get("vllm_dsv4_indexer_mxfp4", "kv_planes").program
    for plane in indexer.planes:
        blocks = plane.path("blocks")
        assert blocks is not None and blocks.store_run == blocks.load_run == ("N", "C")
    hnd = generated.get("vllm_flash_attn_hnd", "kv_2ltd").program.path("blocks")
    assert hnd is not None and hnd.store_run == ("C",)


def test_a_reason_in_program_keeps_the_connector_on_torch(tmp_path: Path) -> None:
    """Whether the compiled kernel moves a connector is PROGRAM's `compiled`: with a reason
    written there, auto moves it with the torch ops and backend='native' is refused with it."""
    cls = _altered(tmp_path, "    compiled=None,\n", "    compiled='kept on torch for this test',\n")
    assert cls(device="cpu").copy_backend_for("cpu") == "torch"
    with pytest.raises(KVLayoutError, match="backend='native' cannot run on cpu: kept on torch for this test"):
        cls(device="cpu", backend="native").copy_backend_for("cpu")
    reference = _store(generated.get("vllm_flash_attn_nhd", "kv_2ltd"), "torch")
    calls = native.stats["calls"]
    auto = _store(cls, None)
    assert native.stats["calls"] == calls
    assert torch.equal(auto, reference) and (auto >= 0).all()


# -- transfers: the same for a layout-to-layout transfer's PROGRAM ------------------------------------------------

XFER = "xfer__vllm_flash_attn_hnd__vllm_flash_attn_nhd"  # L x [KV B H N C] -> L x [KV B N H C]
DST_OLD = "    dst_places=(('KV', 0, ()), ('B', 1, ()), ('N', 2, ()), ('H', 3, ()), ('C', 4, ())),\n"
DST_NEW = "    dst_places=(('KV', 3, ()), ('B', 1, ()), ('N', 2, ()), ('H', 0, ()), ('C', 4, ())),\n"


def _altered_transfer(tmp_path: Path, old: str, new: str) -> Any:
    text = (Path(generated.__file__).parent / f"{XFER}.py").read_text()
    assert text.count(old) == 1, old
    path = tmp_path / f"altered_{XFER}.py"
    path.write_text(text.replace(old, new))
    spec = importlib.util.spec_from_file_location(f"altered_{XFER}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Transfer


@pytest.mark.parametrize("layerwise", [False, True])
def test_the_places_of_a_transfer_program_decide_where_the_kernel_writes(tmp_path: Path, layerwise: bool) -> None:
    """The destination's KV and H places swapped in PROGRAM (two of each): every moved slot
    gets the reference's values with K/V and heads transposed, every other slot keeps its own."""
    hnd, nhd = LIBRARY_SPECS["vllm_flash_attn_hnd"], LIBRARY_SPECS["vllm_flash_attn_nhd"]
    assert SRC_EXT["KV"] == SRC_EXT["H"] == 2
    src = make_transfer_cache(hnd, SRC_EXT, torch.float32, "cpu")
    original = make_transfer_cache(nhd, DST_EXT, torch.float32, "cpu", 10000)
    slots_s, slots_d = torch.tensor([0, 1, 2, 3, 9, 17]), torch.tensor([4, 5, 6, 7, 0, 30])
    reference = [t.clone() for t in original]
    generated.transfer("vllm_flash_attn_hnd", "vllm_flash_attn_nhd")(copy_backend="torch").copy(
        src, slots_s, reference, slots_d)
    altered = [t.clone() for t in original]
    t = _altered_transfer(tmp_path, DST_OLD, DST_NEW)(copy_backend="native")
    calls = native.stats["calls"]
    if layerwise:
        for _ in t.copy_layers(src, slots_s, altered, slots_d):
            pass
    else:
        t.copy(src, slots_s, altered, slots_d)
    assert native.stats["calls"] > calls
    b, n = slots_d // DST_EXT["N"], slots_d % DST_EXT["N"]
    for got, ref, before in zip(altered, reference, original, strict=True):
        want = before.clone()
        want[:, b, n] = ref.transpose(0, 3)[:, b, n]
        assert not torch.equal(got, ref) and torch.equal(got, want)


# -- caches of several planes: one program per plane ----------------------------------------------------------

PLANES_MODULE = "vllm_fp8_tensor_scales__kv_planes"  # per layer (kv [KV B N H C] fp8, k_scale, v_scale)
KV_OLD = "            cache_places=(('KV', 0, ()), ('B', 1, ()), ('N', 2, ()), ('H', 3, ()), ('C', 4, ())),\n"
KV_NEW = "            cache_places=(('KV', 3, ()), ('B', 1, ()), ('N', 2, ()), ('H', 0, ()), ('C', 4, ())),\n"


def _planes_store(cls: Any, backend: str, cache: Any, module: str = PLANES_MODULE) -> torch.Tensor:
    c = cls(device="cpu", backend=backend)
    tokens = len(MAPPING)
    o = torch.zeros(tuple(c.get_shape(tokens, cache)), dtype=c.get_dtype(cache))
    c.from_gpu(MemoryObj(o), 0, tokens, kvcaches=cache, slot_mapping=MAPPING)
    return o


@pytest.mark.parametrize("backend", ["native", "torch", "triton"])
def test_each_plane_moves_as_its_own_program_says(tmp_path: Path, backend: str) -> None:
    """The kv plane's program with the cache's KV and H places swapped (two of each): every
    mover (the native kernel, the generated torch copies, the Triton kernels) fills the kv
    region with K/V and heads transposed; the scale planes, whose programs are unchanged, land
    as the reference puts them."""
    _mover_here(backend)
    paged = LIBRARY_SPECS["vllm_fp8_tensor_scales"]
    assert EXT["KV"] == EXT["H"] == 2
    cache = make_cache(paged, torch.float32, "cpu")
    tokens = len(MAPPING)
    plain = generated.get("vllm_fp8_tensor_scales", "kv_planes")
    reference = _planes_store(plain, "torch", cache)
    assert torch.equal(_planes_store(plain, backend, cache), reference)
    altered = _planes_store(_altered(tmp_path, KV_OLD, KV_NEW, PLANES_MODULE), backend, cache)
    size = EXT["KV"] * tokens * EXT["H"] * EXT["C"]  # the kv region of a layer: fp8, one byte a value
    shape = (EXT["L"], EXT["KV"], tokens, EXT["H"], EXT["C"])
    assert torch.equal(altered[:, :size].reshape(shape), reference[:, :size].reshape(shape).transpose(1, 3))
    assert not torch.equal(altered[:, :size], reference[:, :size])
    assert torch.equal(altered[:, size:], reference[:, size:])


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_loading_planes_through_an_altered_program_reads_the_places_it_names(tmp_path: Path, backend: str) -> None:
    """The load direction of a plane follows its program too: the object whose kv region has
    K/V and heads transposed, loaded through the swapped program, puts every moved slot of the
    kv plane back as the cache held it (and the scales as they were)."""
    paged = LIBRARY_SPECS["vllm_fp8_tensor_scales"]
    cache = make_cache(paged, torch.float32, "cpu")
    tokens = len(MAPPING)
    reference = _planes_store(generated.get("vllm_fp8_tensor_scales", "kv_planes"), "torch", cache)
    size = EXT["KV"] * tokens * EXT["H"] * EXT["C"]
    shape = (EXT["L"], EXT["KV"], tokens, EXT["H"], EXT["C"])
    swapped = reference.clone()
    swapped[:, :size] = reference[:, :size].reshape(shape).transpose(1, 3).reshape(EXT["L"], size)
    cls = _altered(tmp_path, KV_OLD, KV_NEW, PLANES_MODULE)
    c = cls(device="cpu", backend=backend)
    target = make_cache(paged, torch.float32, "cpu")
    for layer in target:  # every leaf zeroed: what the load does not write stays 0
        for t in layer:
            t.zero_()
    c.to_gpu(MemoryObj(swapped, c.format), 0, tokens, kvcaches=target, slot_mapping=MAPPING)
    moved = torch.zeros(EXT["B"] * EXT["N"], dtype=torch.bool)
    moved[MAPPING] = True
    for layer, (got, want) in enumerate(zip(target, cache, strict=True)):
        kv_got, kv_want = got[0].view(torch.uint8), want[0].view(torch.uint8)
        kv_got = kv_got.view(EXT["KV"], EXT["B"] * EXT["N"], -1)
        kv_want = kv_want.view(EXT["KV"], EXT["B"] * EXT["N"], -1)
        assert torch.equal(kv_got[:, moved], kv_want[:, moved]), layer
        assert not kv_got[:, ~moved].any(), layer
        for g, w in zip(got[1:], want[1:], strict=True):  # each layer's k_scale and v_scale, bit for bit
            assert torch.equal(g.reshape(1).view(torch.uint8), w.reshape(1).view(torch.uint8)), layer


@pytest.mark.parametrize("layerwise", [False, True])
def test_planes_that_interleave_in_the_cache_move_in_one_walk(layerwise: bool, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """The Triton backend's int8 cache keeps each head's K data, K scale, V data and V scale in one
    row: the native mover moves both planes in one kernel walk per path (not one per plane, which
    reads every row twice), with the bytes the torch copies put there; with the walk refused, it
    moves the planes one by one, to the same bytes."""
    paged = LIBRARY_SPECS["vllm_int8_per_token_head"]
    cache = make_cache(paged, torch.float32, "cpu")
    mapping = torch.tensor([2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 40, 45])  # a partial block, two whole ones, two tokens
    tokens = len(mapping)
    obj = "kv_planes_layer" if layerwise else "kv_planes"

    def store(backend: str) -> tuple[list[torch.Tensor], int]:
        c = generated.get("vllm_int8_per_token_head", obj)(device="cpu", backend=backend)
        count = EXT["L"] if layerwise else 1
        objs = [MemoryObj(torch.zeros(tuple(c.get_shape(tokens, cache)), dtype=c.get_dtype(cache)))
                for _ in range(count)]
        calls = native.stats["calls"]
        if layerwise:
            for _ in c.batched_from_gpu([[o] for o in objs], [0], [tokens], kvcaches=cache, slot_mapping=mapping):
                pass
        else:
            c.from_gpu(objs[0], 0, tokens, kvcaches=cache, slot_mapping=mapping)
        return [o.tensor for o in objs], native.stats["calls"] - calls

    reference, _ = store("torch")
    joined, walks = store("native")
    monkeypatch.setattr(native_mover, "joint", lambda planes: None)
    apart, calls = store("native")
    layers = EXT["L"] if layerwise else 1
    assert walks == 2 * layers and calls == 2 * walks  # blocks and tokens; per plane without the joint walk
    for a, b, c in zip(reference, joined, apart, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c) and bool(a.any())


# -- the device registry: a device is one registration --------------------------------------------------------

def test_a_device_is_one_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    """One DeviceKind says everything kvgen needs of a device type: its backend, its copy word,
    its Triton targets and the movers auto tries there, in order."""
    monkeypatch.setattr(devices, "_DEVICES", dict(devices._DEVICES))
    devices.register_device(devices.DeviceKind("mtia", lambda d: devices.CpuBackend(), word=4,
                                               movers=("native", "torch")))
    cls = generated.get("vllm_flash_attn_nhd", "kv_2ltd")
    c = cls(device="mtia")
    assert isinstance(devices.backend_for("mtia"), devices.CpuBackend) and max_word(torch.device("mtia")) == 4
    assert choose(c, torch.device("mtia"), None).mover.name == "torch"  # native refuses a device that is no CPU
    assert choose(c, torch.device("cpu"), None).mover.name == "native"
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # another test may have switched the interpreter on
    why = kernels.unavailable(torch.device("mtia")) or ""
    assert "Triton has no backend for mtia devices" in why or "triton is not installed" in why
    with pytest.raises(KVLayoutError, match="backend='native' cannot run here: the compiled kernel moves CPU tensors"):
        cls(device="mtia", backend="native")
