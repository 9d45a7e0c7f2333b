"""The movers execute the planner's description: PROGRAM in the generated module decides what
the compiled CPU kernel moves, and whether it moves a connector at all. A copy of a generated
module with PROGRAM altered (and nothing else) makes the native mover move other bytes, in
the way the alteration says; so no mover re-plans from the layout facts at run time.

Every cache value is its own flat position in the cache, so a K/V or layer swap, a transposition
or a lost token shows."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import builtin_library

from kvgen import generated
from kvgen.errors import KVLayoutError
from kvgen.oracle.scenarios import EXT, make_cache
from kvgen.oracle.transfer_scenarios import DST_EXT, SRC_EXT
from kvgen.oracle.transfer_scenarios import make_cache as make_transfer_cache
from kvgen.runtime import MemoryObj, devices, kernels, native
from kvgen.runtime.connector import max_word
from kvgen.runtime.movers import native as native_mover
from kvgen.runtime.movers.choose import choose

pytestmark = pytest.mark.skipif(bool(native.unavailable()), reason=f"no compiled kernel: {native.unavailable()}")

LIBRARY_SPECS = builtin_library()
MODULE = "vllm_flash_attn_nhd__kv_2ltd"  # cache L x [KV B N H C], object [KV L T (H C)]
#: Two layers and K/V, so that swapping the object's KV and L places keeps every address inside it.
L, KV, B, N, H, C = 2, 2, 6, 4, 2, 3
#: Tokens 0-9 at slots 2..11: a partial block (the token path), then blocks 1 and 2 whole (the block path).
MAPPING = torch.arange(2, 12)


def _altered(tmp_path: Path, old: str, new: str) -> Any:
    """The Connector of a copy of MODULE whose text has `old` (found once) replaced by `new`."""
    text = (Path(generated.__file__).parent / f"{MODULE}.py").read_text()
    assert text.count(old) == 1, old
    path = tmp_path / f"altered_{MODULE}.py"
    path.write_text(text.replace(old, new))
    spec = importlib.util.spec_from_file_location(f"altered_{MODULE}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Connector


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


def test_the_object_places_of_program_decide_where_the_native_mover_writes(tmp_path: Path) -> None:
    """PROGRAM with the object's KV and L places swapped: the native mover writes layer l's K or
    V where the object's [kv=l, layer=kv] entry is, which is the reference object transposed."""
    reference = _store(generated.get("vllm_flash_attn_nhd", "kv_2ltd"), "torch")
    assert torch.equal(_store(generated.get("vllm_flash_attn_nhd", "kv_2ltd"), "native"), reference)
    altered = _store(_altered(tmp_path, SWAP_OLD, SWAP_NEW), "native")
    assert not torch.equal(altered, reference)
    assert torch.equal(altered, reference.transpose(0, 1))


def test_loading_through_an_altered_program_reads_the_places_it_names(tmp_path: Path) -> None:
    """The load direction follows the same places: the transposed object loaded through the
    swapped PROGRAM puts every moved slot back as it was in the cache."""
    reference = _store(generated.get("vllm_flash_attn_nhd", "kv_2ltd"), "torch")
    cls = _altered(tmp_path, SWAP_OLD, SWAP_NEW)
    c = cls(device="cpu", backend="native")
    target = [torch.zeros(KV, B, N, H, C) for _ in range(L)]
    c.to_gpu(MemoryObj(reference.transpose(0, 1).contiguous(), c.format), 0, len(MAPPING), kvcaches=target,
             slot_mapping=MAPPING)
    moved = torch.zeros(B * N, dtype=torch.bool)
    moved[MAPPING] = True
    for layer, (got, want) in enumerate(zip(target, _cache(), strict=True)):
        got, want = got.view(KV, B * N, H, C), want.view(KV, B * N, H, C)
        assert torch.equal(got[:, moved], want[:, moved]), layer
        assert not got[:, ~moved].any(), layer


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


def test_each_plane_moves_as_its_own_program_says(tmp_path: Path) -> None:
    """The kv plane's program with the cache's KV and H places swapped (two of each): the native
    mover fills the kv region with K/V and heads transposed; the scale planes, whose programs
    are unchanged, land as the reference puts them."""
    paged = LIBRARY_SPECS["vllm_fp8_tensor_scales"]
    assert EXT["KV"] == EXT["H"] == 2
    cache = make_cache(paged, torch.float32, "cpu")
    tokens = len(MAPPING)

    def store(cls: Any, backend: str) -> torch.Tensor:
        c = cls(device="cpu", backend=backend)
        o = torch.zeros(tuple(c.get_shape(tokens, cache)), dtype=c.get_dtype(cache))
        c.from_gpu(MemoryObj(o), 0, tokens, kvcaches=cache, slot_mapping=MAPPING)
        return o

    plain = generated.get("vllm_fp8_tensor_scales", "kv_planes")
    reference = store(plain, "torch")
    assert torch.equal(store(plain, "native"), reference)
    text = (Path(generated.__file__).parent / f"{PLANES_MODULE}.py").read_text()
    assert text.count(KV_OLD) == 1
    path = tmp_path / f"altered_{PLANES_MODULE}.py"
    path.write_text(text.replace(KV_OLD, KV_NEW))
    spec = importlib.util.spec_from_file_location(f"altered_{PLANES_MODULE}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    altered = store(module.Connector, "native")
    size = EXT["KV"] * tokens * EXT["H"] * EXT["C"]  # the kv region of a layer: fp8, one byte a value
    shape = (EXT["L"], EXT["KV"], tokens, EXT["H"], EXT["C"])
    assert torch.equal(altered[:, :size].reshape(shape), reference[:, :size].reshape(shape).transpose(1, 3))
    assert not torch.equal(altered[:, :size], reference[:, :size])
    assert torch.equal(altered[:, size:], reference[:, size:])


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
