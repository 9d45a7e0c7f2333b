"""The compiled CPU copy path (backend="native", kvgen.runtime.native): what it serves, that
it moves every layout's data exactly as the reference does (coordinate-coded caches and
objects, both directions), threads, its compile cache, and the torch fallback where no
compiler is present. test_connectors runs every connector in every scenario with the
default backend, which on a CPU with a compiler is this path (checked below)."""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import math
import os
import random
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import (
    EXT,
    SCENARIOS,
    builtin_library,
    builtin_plans,
    make_cache,
    obj_tensors,
    reference_load,
    reference_store,
    same_bits,
)

from kvgen import generated
from kvgen.errors import KVLayoutError
from kvgen.oracle.scenarios import (
    check_connector,
    clone_tree,
    connector_load,
    connector_store,
    fitted,
    make_objects,
    tensors_of,
)
from kvgen.plan.copy import CopyPlan
from kvgen.runtime import MemoryObj, host, native
from kvgen.runtime.connector import Call
from kvgen.runtime.movers import native as native_mover
from kvgen.runtime.slots import Chunk

LIBRARY = builtin_library()
PLANS = list(builtin_plans())
#: Connectors of one-tree caches, and of caches of several planes (split axes among them:
#: tests/test_split_connectors.py), all on the compiled path.
TREE = [p for p in PLANS if isinstance(p, CopyPlan)]
PLANES = [p for p in PLANS if not isinstance(p, CopyPlan)]
#: Scenarios that reach every branch of the kernel: whole blocks by id and as one slice,
#: token paths with and without positions, -1 everywhere, several chunks, strided and odd caches.
SOME = [SCENARIOS[n] for n in ("partial_blocks", "consecutive_blocks", "minus1_chunk_ends", "random_slots",
                               "strided_cache", "odd_offset_objects")]

needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C compiler here")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A private compile cache, forgotten again afterwards."""
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path / "cache"))
    native.reset()
    yield tmp_path / "cache" / "native"
    native.reset()


@pytest.fixture
def reloaded():
    """The kernel library loaded again after the test (which may change its environment)."""
    native.reset()
    yield
    native.reset()


@needs_compiler
def test_cpu_connectors_default_to_native() -> None:
    """So the default suite's connector checks run this path: connectors of one-tree caches
    and of caches of several planes (one description per plane, kvgen.plan.program) alike."""
    assert len(TREE) > 50 and len(PLANES) > 10 and any(p.tiled for p in PLANES)
    for p in TREE + PLANES:
        assert generated.get(p.paged.name, p.obj.name)(device="cpu").copy_backend_for("cpu") == "native", p.module
        assert generated.get(p.paged.name, p.obj.name)(device="cpu", backend="native").copy_backend_for("cpu") \
            == "native", p.module


@needs_compiler
@pytest.mark.parametrize("plan", TREE, ids=lambda p: p.module)
def test_native_matches_reference(plan) -> None:
    """Forced native, each connector against the reference in both directions; the kernel ran."""
    before = native.stats["calls"], native.stats["fallbacks"]
    results = check_connector(generated, plan.paged, plan.obj, "cpu", SOME, backend="native")
    assert results == [(True, True)] * len(SOME)
    assert native.stats["calls"] > before[0] and native.stats["fallbacks"] == before[1]


@needs_compiler
@pytest.mark.parametrize("plan", [p for p in PLANES if p.tiled], ids=lambda p: p.module)
def test_native_moves_split_axes_like_the_reference(plan) -> None:
    """Built-in caches with split (tiled) axes, forced native, against the reference both ways:
    the kernel ran every chunk (a refusal would have raised, a fallback counted)."""
    before = native.stats["calls"], native.stats["fallbacks"]
    results = check_connector(generated, plan.paged, plan.obj, "cpu", SOME, backend="native")
    assert results == [(True, True)] * len(SOME)
    assert native.stats["calls"] > before[0] and native.stats["fallbacks"] == before[1]


@needs_compiler
@pytest.mark.parametrize("team", [True, False], ids=["torch_openmp_team", "own_threads"])
@pytest.mark.parametrize("module", ["vllm_flash_attn_nhd__kv_2ltd", "vllm_flash_attn_hnd__kv_t2d",
                                    "hicache_layer_first__kv_2td", "sglang_mha__kv_2ltd"])
def test_threads_share_the_work(module: str, team: bool, reloaded: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several threads, each a share of the outermost dim, move exactly what one does: on
    torch's OpenMP threads where the kernel found them, else on threads of its own."""
    monkeypatch.setattr(native_mover, "cpu_threads", lambda nbytes, parallel_bytes=0: 3)
    monkeypatch.setenv("KVGEN_NATIVE_OPENMP", "1" if team else "0")
    assert (native.team() is not None) == (team and host.torch_openmp() is not None)
    plan = next(p for p in TREE if p.module == module)
    assert check_connector(generated, plan.paged, plan.obj, "cpu", list(SCENARIOS.values()), backend="native") \
        == [(True, True)] * len(SCENARIOS)


@needs_compiler
def test_torch_openmp_runtime_is_found_here() -> None:
    """This suite's torch runs on OpenMP (Linux wheels do): the kernel shares its threads."""
    if not torch._C.has_openmp:
        pytest.skip("this torch was built without OpenMP")
    assert host.torch_openmp() is not None
    assert native.team() == host.torch_openmp()


@needs_compiler
@pytest.mark.serial  # threads of its own, within a time limit
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_moves_chunks_on_threads_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's OpenMP team does not survive a fork: a child that used it would wait forever.
    The parent shares the team; the forked child still stores a chunk (bit-exact to the
    parent's) within seconds."""
    monkeypatch.setattr(native_mover, "cpu_threads", lambda nbytes, parallel_bytes=0: 2)
    paged, obj = LIBRARY["vllm_flash_attn_nhd"], LIBRARY["kv_2ltd"]
    cache = make_cache(paged, torch.float32, "cpu")
    c = generated.get(paged.name, obj.name)(device="cpu")
    c.bind(cache)
    slots = torch.arange(16, dtype=torch.long)
    first = MemoryObj(torch.zeros(c.get_shape(16)), c.format)
    c.from_gpu(first, 0, 16, kvcaches=cache, slot_mapping=slots)  # the parent's parallel region
    second = MemoryObj(torch.zeros(c.get_shape(16)), c.format)
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only when its store matches the parent's
        try:
            c.from_gpu(second, 0, 16, kvcaches=cache, slot_mapping=slots)
            os._exit(0 if native.team() is None and torch.equal(first.tensor, second.tensor) else 3)
        except BaseException:
            os._exit(4)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child did not finish its store within 30 s")


def test_streaming_stores_for_chunks_of_stream_bytes_and_more() -> None:
    assert not host.streams(host.STREAM_BYTES - 1)
    assert host.streams(host.STREAM_BYTES)


@needs_compiler
def test_leaves_with_different_strides_fall_back_to_torch() -> None:
    """A cache whose leaves differ in strides is no single description: auto moves it by
    torch ops (same bits as backend='torch'); forced native refuses before any write."""
    paged, obj = LIBRARY["vllm_flash_attn_nhd"], LIBRARY["kv_2ltd"]
    sc = SCENARIOS["partial_blocks"]
    cache = make_cache(paged, torch.float32, "cpu")
    other = make_cache(paged, torch.float32, "cpu", strided=True)
    cache[1] = other[1]  # same shape and values, other strides
    mapping = torch.tensor(sc.mapping(random.Random(1), EXT), dtype=torch.long)
    lengths = [e - s for s, e in zip(sc.starts, sc.ends, strict=True)]
    got = {}
    for backend in (None, "torch"):
        c = generated.get(paged.name, obj.name)(device="cpu", backend=backend)
        c.bind(cache)
        objs = make_objects(c, lengths, torch.float32, "cpu", salt=3)
        fallbacks = native.stats["fallbacks"]
        connector_store(c, objs, sc, cache, mapping)
        got[backend] = [o.tensor.clone() for o in objs]
        if backend is None:
            assert native.stats["fallbacks"] > fallbacks
    assert all(torch.equal(a, b) for a, b in zip(got[None], got["torch"], strict=True))
    forced = generated.get(paged.name, obj.name)(device="cpu", backend="native")
    forced.bind(cache)
    objs = make_objects(forced, lengths, torch.float32, "cpu", salt=3)
    before = [o.tensor.clone() for o in objs]
    with pytest.raises(KVLayoutError, match="backend='native' cannot move this cache: .*strides"):
        connector_store(forced, objs, sc, cache, mapping)
    assert all(torch.equal(o.tensor, b) for o, b in zip(objs, before, strict=True))


def test_no_compiler_means_the_torch_path(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGEN_CC", "")
    assert native.compiler() is None
    assert "no C compiler" in (native.unavailable() or "")
    paged, obj = LIBRARY["vllm_flash_attn_hnd"], LIBRARY["kv_t2d"]
    c = generated.get(paged.name, obj.name)(device="cpu")
    assert c.copy_backend_for("cpu") == "torch"
    calls = native.stats["calls"]
    assert check_connector(generated, paged, obj, "cpu", SOME) == [(True, True)] * len(SOME)
    assert native.stats["calls"] == calls
    with pytest.raises(KVLayoutError, match="backend='native' cannot run here: no C compiler"):
        generated.get(paged.name, obj.name)(device="cpu", backend="native")
    assert not fresh.exists()  # nothing was compiled


def test_switched_off(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGEN_NATIVE", "0")
    c = generated.get("vllm_flash_attn_nhd", "kv_2ltd")(device="cpu")
    assert c.copy_backend_for("cpu") == "torch"


def test_a_broken_compiler_means_the_torch_path(fresh: Path, monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'cc: cannot compile' >&2\nexit 1\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("KVGEN_CC", str(broken))
    why = native.unavailable() or ""
    assert "could not be compiled" in why and "cannot compile" in why
    assert generated.get("vllm_flash_attn_nhd", "kv_2ltd")(device="cpu").copy_backend_for("cpu") == "torch"
    assert not list(fresh.glob("*.so"))


@needs_compiler
def test_compile_cache_is_keyed_reused_and_atomic(fresh: Path) -> None:
    """One library per source, compiler and flags, compiled once; concurrent builds into an
    empty cache each rename a whole file into place and leave no temporaries."""
    cc = native.compiler()
    assert cc is not None
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: native._build(cc, fresh), range(3)))
    assert len(set(paths)) == 1 and paths[0].parent == fresh and paths[0].name.startswith("kvcopy-")
    assert sorted(os.listdir(fresh)) == [paths[0].name]
    mtime = paths[0].stat().st_mtime_ns
    assert native.library() is not None and native.unavailable() is None
    assert native._build(cc, fresh) == paths[0] and paths[0].stat().st_mtime_ns == mtime  # reused


@needs_compiler
@pytest.mark.parametrize("stream", [False, True], ids=["plain_stores", "streaming_stores"])
def test_load_and_store_round_trip_big_rows(stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 rows of 128 values (runs of whole words, the inline copy; or streamed, as a
    chunk larger than the last-level cache is) through a layerwise HND connector whose runs
    are one head: values encode (layer, token, kv, head, c)."""
    monkeypatch.setattr(host, "streams", lambda nbytes: stream)
    paged, obj = LIBRARY["vllm_flash_attn_hnd"], LIBRARY["kv_t2d"]
    layers, heads, size, blocks, n = 2, 2, 128, 6, 4
    cache = [torch.zeros(2, blocks, heads, n, size, dtype=torch.bfloat16) for _ in range(layers)]
    c = generated.get(paged.name, obj.name)(device="cpu", backend="native")
    c.bind(cache)
    tokens = 7
    slots = torch.tensor([9, 10, 11, 12, 13, 14, 15], dtype=torch.long)  # a partial block, then a whole one
    objs = []
    for layer in range(layers):
        t = torch.empty(c.get_shape(tokens), dtype=torch.bfloat16)  # [T, KV, H*C]
        code = torch.arange(t.numel(), dtype=torch.int32).view(t.shape) % 251 + 256 * layer
        t.copy_(code.to(torch.bfloat16))
        objs.append(MemoryObj(t, c.format))
    gen = c.batched_to_gpu([0], [tokens], kvcaches=cache, slot_mapping=slots)
    next(gen)
    for o in objs:
        gen.send([o])
    next(gen)
    for layer in range(layers):
        for i, s in enumerate(slots.tolist()):
            for kv in range(2):
                want = objs[layer].tensor[i, kv].view(heads, size)
                assert torch.equal(cache[layer][kv, s // n, :, s % n, :], want)
    back = [MemoryObj(torch.zeros(c.get_shape(tokens), dtype=torch.bfloat16), None) for _ in range(layers)]
    for _ in c.batched_from_gpu([[b] for b in back], [0], [tokens], kvcaches=clone_tree(cache), slot_mapping=slots):
        pass
    assert all(torch.equal(b.tensor, o.tensor) for b, o in zip(back, objs, strict=True))


@needs_compiler
def test_skip_prefix_with_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load told to skip the first tokens leaves their slots alone (reference comparison)."""
    paged, obj = LIBRARY["vllm_kv_tuple"], LIBRARY["kv_2ltd"]
    sc = SCENARIOS["whole_blocks"]
    rng = random.Random(5)
    mapping_list = sc.mapping(rng, EXT)
    mapping = torch.tensor(mapping_list, dtype=torch.long)
    c = generated.get(paged.name, obj.name)(device="cpu", backend="native")
    cache = make_cache(paged, torch.float32, "cpu")
    c.bind(cache)
    objs = make_objects(c, [16], torch.float32, "cpu", salt=9, fmt=c.format)
    want = clone_tree(cache)
    connector_load(c, objs, replace(sc, skip=5), cache, mapping)
    t = objs[0].tensor  # [KV L T (H C)]
    for layer in range(len(want)):
        for kv in range(2):
            leaf = want[layer][kv].view(-1, t.shape[-1])  # [S (H C)]
            for i in range(5, 16):
                leaf[mapping_list[i]] = t[kv, layer, i]
    assert all(torch.equal(a, b) for a, b in zip([x for pair in cache for x in pair],
                                                 [x for pair in want for x in pair], strict=True))


# -- the build folder: only this user may write what the process loads ---------------------------------

needs_root = pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="chown to another uid needs root")
#: A uid that is not this process's (nobody).
OTHER_UID = 65534


def planted_library(where: Path, name: str, marker: Path) -> Path:
    """A library that, once loaded, creates `marker`: what another user could plant."""
    src = where / "planted.c"
    src.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void run(void) {{ '
                   f'FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\nint kvgen_abi(void) {{ return 3; }}\n')
    out = where / name
    subprocess.run([native.compiler(), "-shared", "-fPIC", "-o", str(out), str(src)], check=True, timeout=60)
    src.unlink()
    return out


def the_library_name(fresh: Path) -> str:
    """The name this process's kernel build has (built once in a scratch folder)."""
    cc = native.compiler()
    assert cc is not None
    scratch = fresh.parent / "scratch"
    return native._build(cc, scratch).name


@needs_compiler
def test_build_folder_and_library_are_private(fresh: Path) -> None:
    """Created with mode 0700, the library written by this user only, whatever the umask."""
    old = os.umask(0o002)
    try:
        path = native._build(native.compiler() or "", fresh)
    finally:
        os.umask(old)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    st = path.stat()
    assert st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    assert native.library() is not None


@needs_compiler
@pytest.mark.parametrize("mode", [0o770, 0o707], ids=["group_writable", "world_writable"])
def test_a_folder_others_may_write_is_refused(fresh: Path, mode: int) -> None:
    fresh.mkdir(parents=True)
    fresh.chmod(mode)
    assert "group or others may write it" in (native.unavailable() or "")
    assert generated.get("vllm_flash_attn_nhd", "kv_2ltd")(device="cpu").copy_backend_for("cpu") == "torch"
    assert not list(fresh.iterdir())  # nothing was compiled there


@needs_compiler
@needs_root
@pytest.mark.parametrize("planted", ["folder", "library"])
def test_what_another_user_owns_is_never_loaded(fresh: Path, tmp_path: Path, planted: str) -> None:
    """A library another user (uid 65534) put under the name this process's build has, or a
    folder that user made, is refused before it is loaded: its code never runs here."""
    name = the_library_name(fresh)
    marker = tmp_path / "planted-code-ran"
    fresh.mkdir(parents=True, mode=0o700)
    library = planted_library(fresh, name, marker)
    os.chown(fresh if planted == "folder" else library, OTHER_UID, OTHER_UID)
    why = native.unavailable() or ""
    assert f"owned by uid {OTHER_UID}" in why and str(fresh) in why
    assert not marker.exists(), "the planted library was loaded"
    with pytest.raises(KVLayoutError, match="backend='native' cannot run here: .*owned by uid 65534"):
        generated.get("vllm_flash_attn_nhd", "kv_2ltd")(device="cpu", backend="native")


@needs_compiler
def test_a_group_writable_library_is_never_loaded(fresh: Path, tmp_path: Path) -> None:
    name = the_library_name(fresh)
    marker = tmp_path / "planted-code-ran"
    fresh.mkdir(parents=True, mode=0o700)
    planted_library(fresh, name, marker).chmod(0o775)
    assert "group or others may write it (mode 775)" in (native.unavailable() or "")
    assert not marker.exists()


@needs_compiler
@needs_root
def test_the_fallback_folder_under_the_temp_dir(fresh: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unwritable home cache sends the build to <tmp>/kvgen-<uid>/native, made 0700; a
    kvgen-<uid> folder another user made there first is refused."""
    real = native._build
    home = fresh

    def unwritable_home(cc: str, where: Path) -> Path:
        if where == home:
            raise PermissionError(13, "Permission denied", str(where))
        return real(cc, where)

    monkeypatch.setattr(native, "_build", unwritable_home)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    ours = tmp_path / "tmp" / f"kvgen-{os.getuid()}"
    assert native.library() is not None
    assert stat.S_IMODE(ours.stat().st_mode) == 0o700 and list((ours / "native").glob("kvcopy-*.so"))
    native.reset()
    shutil.rmtree(ours)
    ours.mkdir(mode=0o777)
    ours.chmod(0o777)
    os.chown(ours, OTHER_UID, OTHER_UID)
    assert f"owned by uid {OTHER_UID}" in (native.unavailable() or "")
    assert not (ours / "native").exists()


# -- index tensors: a strided slot mapping, and the kernel's own contiguity check -----------------------


def strided_mapping(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """`values` as every second entry of a larger tensor, with slots of other tokens between."""
    spread = torch.full((2 * len(values),), 10**6, dtype=dtype)
    spread[::2] = torch.tensor(values, dtype=dtype)
    out = spread[::2]
    assert not out.is_contiguous() and out.tolist() == values
    return out


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("module", ["vllm_flash_attn_nhd__kv_2ltd", "vllm_flash_attn_hnd__kv_t2d",
                                    "sglang_mha__kv_2td"])
@pytest.mark.parametrize("scenario", ["partial_blocks", "random_slots"])
def test_a_strided_slot_mapping_moves_on_the_compiled_path(module: str, dtype: torch.dtype, scenario: str) -> None:
    """The docs accept any 1-D signed integer slot mapping: a strided one (a view into a
    larger batch's) moves on the kernel, forced or by default, exactly as the reference."""
    plan = next(p for p in TREE if p.module == module)
    sc = SCENARIOS[scenario]
    values = sc.mapping(random.Random(2), EXT)
    lengths = [e - s for s, e in zip(sc.starts, sc.ends, strict=True)]
    for backend in ("native", None):
        c = generated.get(plan.paged.name, plan.obj.name)(device="cpu", backend=backend)
        cache = make_cache(plan.paged, torch.float32, "cpu")
        c.bind(cache)
        got = make_objects(c, lengths, torch.float32, "cpu", salt=5)
        want = make_objects(c, lengths, torch.float32, "cpu", salt=5)
        calls, fallbacks = native.stats["calls"], native.stats["fallbacks"]
        connector_store(c, got, sc, cache, strided_mapping(values, dtype))
        reference_store(plan.paged, plan.obj, cache, want, sc, values)
        assert same_bits([obj_tensors(o) for o in got], [obj_tensors(o) for o in want])
        for group in got:
            for o in group if isinstance(group, list) else [group]:
                o.metadata.fmt = c.format
        expected = clone_tree(cache)
        connector_load(c, got, sc, cache, strided_mapping(values, dtype))
        reference_load(plan.paged, plan.obj, expected, got, sc, values)
        assert same_bits(cache, expected)
        assert native.stats["calls"] > calls and native.stats["fallbacks"] == fallbacks


@needs_compiler
@pytest.mark.parametrize("field", ["slots", "tok", "block_ids"])
@pytest.mark.parametrize("how", ["strided", "int32"])
def test_the_kernel_takes_only_contiguous_int64_index_tensors(field: str, how: str) -> None:
    """The kernel reads index tensors as packed int64 arrays: a chunk whose slots, token
    positions or block ids are strided or narrower is refused before anything is written
    (the connectors hand it contiguous int64 ones; this check is the kernel's last guard)."""
    paged, obj = LIBRARY["vllm_flash_attn_nhd"], LIBRARY["kv_2ltd"]
    c = generated.get(paged.name, obj.name)(device="cpu", backend="native")
    cache = make_cache(paged, torch.float32, "cpu")
    g = c.bind(cache)
    n = int(g.N)
    if field == "block_ids":  # two whole blocks by id, 5 then 2
        ck = Chunk(2 * n, 2 * n, None, None, None, None, torch.tensor([5, 2]), 0, 2 * n)
    else:  # three tokens by slot: 9, 30, 17
        slots = torch.tensor([9, 30, 17])
        ck = Chunk(4, 3, torch.tensor([0, 2, 3]), slots, slots // n, slots % n, None, 0, 0)
    index = getattr(ck, field)
    bad = torch.stack([index, index], 1)[:, 0] if how == "strided" else index.to(torch.int32)
    assert torch.equal(bad.long(), index)
    ck = dataclasses.replace(ck, **{field: bad})
    tensor = torch.zeros(c.get_shape(ck.num_tokens))
    binding, tree = c._bind(cache)
    chosen = c._mover_for(torch.device("cpu"))
    with pytest.raises(native.Unsupported, match="index tensors must be contiguous int64"):
        chosen.mover.move(chosen.prepared, True, tensor, Call(binding, tree, torch.arange(0), [ck]), ck, None)
    assert not tensor.any()


# -- streaming stores: odd sizes, every tail ------------------------------------------------------------


def _kernel_copy(lib: object, dst: torch.Tensor, src: torch.Tensor, run: int, stream: bool) -> None:
    """One run of `run` bytes from `src` to `dst` through the kernel (a description of no dims)."""
    leaves = (ctypes.c_void_p * 1)(src.data_ptr())
    assert lib.kvgen_move(1, 0, None, run, ctypes.addressof(leaves), 0, dst.data_ptr(), 1, int(stream)) == 0


@needs_compiler
def test_streamed_runs_of_every_tail_and_alignment() -> None:
    """A streamed run is an unaligned head, 64-byte blocks of 16-byte streaming stores and a
    tail of 0 to 63 bytes: runs of 256 to 383 bytes into destinations at every offset of a
    16-byte lane give every head and tail length. Shorter runs stream only as whole cache lines
    into a line-aligned destination (offset 48 below: 64 bytes into the buffer), and are copied
    plainly at every other offset. Each byte holds its own position (mod 251), and the bytes
    around the destination must stay as they were."""
    lib = native.library()
    src = (torch.arange(1024, dtype=torch.int64) % 251).to(torch.uint8)
    for stream in (True, False):
        for run in range(1, 384):
            for shift in [*range(16), 48]:
                dst = torch.full((run + 128,), 255, dtype=torch.uint8)
                assert dst.data_ptr() % 64 == 0  # so that offset 64 is a line boundary
                _kernel_copy(lib, dst[16 + shift:], src[3:], run, stream)
                want = torch.full_like(dst, 255)
                want[16 + shift:16 + shift + run] = src[3:3 + run]
                assert torch.equal(dst, want), f"run {run}, destination offset {shift}, stream {stream}"


@needs_compiler
@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_streamed_chunk_of_odd_rows_moves_exactly(direction: str) -> None:
    """A float32 NHD chunk of ~9 MiB (above host.STREAM_BYTES, so written with streaming
    stores) whose rows are 127 values: runs of odd lengths on both the block and the token
    path. Every element holds its own flat position in its tensor (plus the layer's base)."""
    paged, obj = LIBRARY["vllm_flash_attn_nhd"], LIBRARY["kv_2ltd"]
    layers, heads, size, n, blocks, tokens = 4, 2, 127, 16, 80, 1100
    shape = (2, blocks, n, heads, size)
    per = math.prod(shape)
    cache = [torch.arange(per, dtype=torch.float32) + layer * per for layer in range(layers)]
    cache = [t.view(shape) for t in cache]
    rng = random.Random(12)
    order = rng.sample(range(blocks), blocks)
    slots = [order[(i + 5) // n] * n + (i + 5) % n for i in range(tokens)]  # starts mid-block
    slots[700] = -1
    mapping = torch.tensor(slots)
    c = generated.get(paged.name, obj.name)(device="cpu", backend="native")
    g = c.bind(cache)
    o = torch.zeros(c.get_shape(tokens))
    assert host.streams(o.numel() * o.element_size()) and g.L == layers
    moved = mapping >= 0
    pos = torch.nonzero(moved).squeeze(1)
    b, p = mapping[moved] // n, mapping[moved] % n
    calls = native.stats["calls"]
    if direction == "store":
        c.from_gpu(MemoryObj(o), 0, tokens, kvcaches=cache, slot_mapping=mapping)
        for layer in range(layers):
            for kv in range(2):
                assert torch.equal(o[kv, layer, pos], cache[layer][kv, b, p].flatten(1))
                assert not o[kv, layer, 700].any()
    else:
        o.copy_(torch.arange(o.numel(), dtype=torch.float32).view(o.shape))
        target = [torch.zeros(shape) for _ in range(layers)]
        c.to_gpu(MemoryObj(o, c.format), 0, tokens, kvcaches=target, slot_mapping=mapping)
        for layer in range(layers):
            want = torch.zeros(shape)
            for kv in range(2):
                want[kv, b, p] = o[kv, layer, pos].view(-1, heads, size)
            assert torch.equal(target[layer], want)
    assert native.stats["calls"] > calls


def _blocks_then_tail(blocks: tuple[int, ...], tail: int) -> Callable[[random.Random, dict[str, int]], list[int]]:
    """A mapping: whole `blocks` in that order, then the first 3 slots of block `tail`."""
    def mapping(rng: random.Random, ext: dict[str, int]) -> list[int]:
        n = ext["N"]
        return [b * n + i for b in blocks for i in range(n)] + [tail * n + i for i in range(3)]
    return mapping


#: Two chunks of one shape (two whole blocks by id, then three tokens by slot) at other slots.
SAME_SHAPE = [replace(SCENARIOS["partial_blocks"], name=f"same_shape_{k}", starts=(0,), ends=(2 * EXT["N"] + 3,),
                      mapping=_blocks_then_tail(blocks, tail))
              for k, (blocks, tail) in enumerate([((3, 1), 5), ((0, 7), 2)])]


@needs_compiler
@pytest.mark.parametrize("module", ["vllm_flash_attn_nhd__kv_2ltd", "vllm_flash_attn_hnd__kv_2td",
                                    "vllm_dsv4_indexer_mxfp4__kv_planes", "vllm_dsv4_indexer__kv_planes_layer"])
def test_a_later_chunk_of_an_earlier_shape_moves_its_own_slots(module: str, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """The mover reuses the work of a recent chunk shape for a later chunk of that shape, with
    the later chunk's block ids and slots put in: through one connector and one cache, each
    of two such chunks (other blocks, other tail slots) moves what the reference moves, both
    ways, and the second reused the first's work."""
    plan = next(p for p in PLANS if p.module == module)
    connector = generated.get(plan.paged.name, plan.obj.name)(device="cpu", backend="native")
    first, second = (fitted(plan.paged, s) for s in SAME_SHAPE)
    cache = make_cache(plan.paged, torch.float32, "cpu", ext=first.ext)
    connector.bind(cache)
    describe, made = native_mover.describe, []

    def spy(*args: Any) -> Any:
        made.append(args[0])
        return describe(*args)

    monkeypatch.setattr(native_mover, "describe", spy)  # the reference never calls it
    for k, sc in enumerate((first, second)):
        mapping_list = sc.mapping(random.Random(0), dict(sc.ext))
        mapping = torch.tensor(mapping_list)
        objs = make_objects(connector, [sc.ends[0]], torch.float32, "cpu", salt=7)
        want = make_objects(connector, [sc.ends[0]], torch.float32, "cpu", salt=7)
        connector_store(connector, objs, sc, cache, mapping)
        reference_store(plan.paged, plan.obj, cache, want, sc, mapping_list)
        assert same_bits([obj_tensors(o) for o in objs], [obj_tensors(o) for o in want]), (module, k)
        for o in objs if not connector.layerwise else objs[0]:
            o.metadata.fmt = connector.format
        for t in tensors_of([obj_tensors(o) for o in objs]):
            t.neg_()  # every value now differs from the cache's
        expected = clone_tree(cache)
        connector_load(connector, objs, sc, cache, mapping)
        reference_load(plan.paged, plan.obj, expected, objs, sc, mapping_list)
        assert same_bits(cache, expected), (module, k)
        if k == 0:
            assert made, "the first chunk was described"
            made.clear()
    assert not made, "the second chunk of the first one's shape was described again"


@needs_compiler
@pytest.mark.parametrize("block", [6, 12, 16])
@pytest.mark.parametrize("module", ["vllm_flash_attn_nhd__kv_2ltd", "vllm_flash_attn_hnd__kv_t2d",
                                    "vllm_dsv4_indexer_mxfp4__kv_planes", "sglang_mha_hnd__kv_t2d"])
def test_blocks_of_any_size_split_slots_like_the_reference(module: str, block: int) -> None:
    """The kernel splits a slot into block and position by a shift and a mask where the block
    size is a power of two and by a division elsewhere: both, against the reference."""
    plan = next(p for p in PLANS if p.module == module)
    scenarios = [replace(s, ext={**s.ext, "N": block}) for s in SOME]
    before = native.stats["fallbacks"]
    assert check_connector(generated, plan.paged, plan.obj, "cpu", scenarios, backend="native") \
        == [(True, True)] * len(SOME)
    assert native.stats["fallbacks"] == before
