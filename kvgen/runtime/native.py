"""The compiled CPU copy path: one C call moves a whole chunk (or one layer of it) between a
paged cache and a memory object, with memcpy over the longest runs both sides keep
contiguous (a whole block at once where the layouts allow).

Why: the torch path issues one or more ops per layer. Each is a parallel region whose
closing barrier waits for every OpenMP thread, which on a host whose cores are busy (a
co-located engine) costs a scheduling slice per op, and each op has a fixed cost that
dominates small chunks. One call with no barriers avoids both.

The kernel (csrc/kvcopy.c) needs no torch headers: it is compiled on first use by the
system C compiler (`KVGEN_CC`, else cc, gcc or clang) into a per-user cache
(`KVGEN_CACHE_DIR`, else $XDG_CACHE_HOME/kvgen or ~/.cache/kvgen), named by a hash of the
source, the compiler and its flags, and loaded with ctypes from a folder and file only this
user may write (host.private_folder). The compiler writes a private temporary file that is
renamed into place, so concurrent processes never load a partial library. Without a
compiler (or with `KVGEN_NATIVE=0`) connectors keep their torch path.

A chunk's shares run on torch's OpenMP worker threads where that runtime is found (see
team()), else on threads of the kernel's own; chunks of 8 MiB or more are written with
streaming stores (host.streams()).

The copy is driven by the connector's layout facts (PagedLayout / ObjectLayout: which
tensor dim holds which axis) and the actual strides of the cache leaves and the object,
so one kernel serves every connector of a one-tree cache; caches of several planes
(format 2) keep the torch path.
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from kvgen.runtime import host
from kvgen.runtime.binding import leaves
from kvgen.runtime.host import cache_dir, compiler, missing_compiler
from kvgen.runtime.layout import Geometry, ObjectLayout, PagedLayout
from kvgen.runtime.slots import Chunk

#: Compiler flags; part of the cache key. No -march=native: the cache may be shared by hosts
#: of one user, and glibc's memcpy already picks the widest vector unit at run time.
FLAGS = ("-O2", "-shared", "-fPIC", "-pthread", "-std=c99")
#: The kernel's calling convention (kvgen_abi() in csrc/kvcopy.c).
ABI = 4
#: Int64 fields per dim (csrc/kvcopy.c) and the most dims it takes.
FIELDS, MAX_DIMS = 9, 8

_lock = threading.Lock()
_state: dict[str, Any] = {}
#: Kernel calls so far (tests use it to see that the compiled path, not torch, moved the data).
stats = {"calls": 0, "fallbacks": 0}


class Unsupported(Exception):
    """A connector or cache the compiled kernel does not describe; the torch path moves it."""


def _source() -> bytes:
    return resources.files("kvgen.runtime").joinpath("csrc/kvcopy.c").read_bytes()


def _compiler_id(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else cc
    except (OSError, subprocess.SubprocessError):
        return cc


def _build(cc: str, where: Path) -> Path:
    """The compiled library in `where`, compiled now unless an identical build is there."""
    source = _source()
    key = hashlib.sha256(b"\0".join([source, cc.encode(), _compiler_id(cc).encode(), " ".join(FLAGS).encode(),
                                     platform.machine().encode()])).hexdigest()[:20]
    target = host.private_folder(where) / f"kvcopy-{key}.so"
    if os.path.lexists(target):
        host.check_library(target)
        return target
    with tempfile.TemporaryDirectory(dir=where, prefix=".build-") as tmp:
        src = Path(tmp) / "kvcopy.c"
        src.write_bytes(source)
        out = Path(tmp) / "kvcopy.so"
        done = subprocess.run([cc, *FLAGS, "-o", str(out), str(src)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0 or not out.exists():
            raise OSError(f"{cc} failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-400:]}")
        out.chmod(0o700)  # whatever the umask: no one else may write what this process loads
        os.replace(out, target)  # atomic: another process sees no file or a whole one
    return target


def _load() -> tuple[Any, str | None]:
    if host.switched_off("KVGEN_NATIVE"):
        return None, "switched off (KVGEN_NATIVE=0)"
    cc = compiler()
    if cc is None:
        return None, missing_compiler()
    try:
        try:
            path = _build(cc, cache_dir())
        except PermissionError:  # an unwritable home: a private folder (0700, checked) of this user
            path = _build(cc, host.private_folder(Path(tempfile.gettempdir()) / f"kvgen-{os.getuid()}") / "native")
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"the CPU kernel could not be compiled or loaded: {exc}"
    if lib.kvgen_abi() != ABI:
        return None, f"{path} speaks another calling convention"
    lib.kvgen_move.restype = ctypes.c_int
    lib.kvgen_move.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.kvgen_use_openmp.restype = None
    lib.kvgen_use_openmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    _state["team"] = _share_torch_team(lib)
    _state["team_pid"] = os.getpid()
    return lib, None


def _share_torch_team(lib: Any) -> str | None:
    """Register torch's OpenMP runtime with the kernel, so its shares run on torch's worker
    threads (which spin for a while after every torch op and would take the cores from
    threads of the kernel's own); returns the runtime's path, or None (own threads)."""
    lib.kvgen_use_openmp(None, None, None)  # the library may be loaded already, registered by an earlier load
    path = host.torch_openmp()
    if path is None or host.switched_off("KVGEN_NATIVE_OPENMP"):
        return None
    entries = host.openmp_entries(path)
    if entries is None:
        return None
    lib.kvgen_use_openmp(*entries)
    return path


def team() -> str | None:
    """The OpenMP runtime whose threads the kernel shares work with; None: threads of its own.

    In a process forked from the one that registered it, None: GNU OpenMP's team does not
    survive a fork (a parallel region in the child waits for the parent's threads forever),
    so the child's kernel starts threads of its own."""
    lib = library()
    if _state.get("team") is not None and _state.get("team_pid") != os.getpid():
        with _lock:
            lib.kvgen_use_openmp(None, None, None)
            _state["team"] = None
    return _state.get("team")


def library() -> Any:
    """The loaded kernel library, compiled on first call; None when it cannot be had."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"], _state["why"] = _load()
    return _state["lib"]


def unavailable() -> str | None:
    """Why the compiled CPU path cannot run here; None when it can."""
    library()
    return _state["why"]


def reset() -> None:
    """Forget the loaded library, the layout maps and the last description (tests switch compilers)."""
    with _lock:
        _state.clear()
        _maps.clear()
        _last.clear()


# -- describing a copy ----------------------------------------------------------------

#: Axes that address tokens: the cache's block, position in block and folded slot, the object's token.
_TOKEN_AXES = {"B", "N", "S", "T"}


class LayoutMap:
    """Which axes a connector's cache and object hold, and where (read once per connector)."""

    def __init__(self, paged: PagedLayout, obj: ObjectLayout):
        if paged.parts or obj.pack is not None:
            raise Unsupported("caches of several planes move by torch ops")
        self.paged, self.obj = paged, obj
        self.layerwise = "L" in obj.lists
        if [a for a in obj.lists if a != "L"]:
            raise Unsupported(f"object list levels {obj.lists}")
        cache_axes = {a for d in paged.dims for a in d} | set(paged.lists)
        obj_axes = {a for d in obj.dims for a in d}
        self.shared = sorted((cache_axes | obj_axes) - _TOKEN_AXES - ({"L"} if self.layerwise else set()))


_maps: dict[tuple[int, int], LayoutMap | Unsupported] = {}


def layout_map(paged: PagedLayout, obj: ObjectLayout) -> LayoutMap:
    key = (id(paged), id(obj))
    found = _maps.get(key)
    if found is None:
        try:
            found = LayoutMap(paged, obj)
        except Unsupported as why:
            found = why
        _maps[key] = found
    if isinstance(found, Unsupported):
        raise found
    return found


def _strides(dims: Any, tensor: torch.Tensor, ext: dict[str, int], folded: bool) -> dict[str, int]:
    """Bytes per step of each axis of `tensor` (dims as declared; a fused dim's inner axes
    step within it); a folded slot axis (B N fused, no block size) is S."""
    out: dict[str, int] = {}
    item = tensor.element_size()
    for axes, step in zip(dims, tensor.stride(), strict=True):
        if folded and axes == ("B", "N"):
            out["S"] = step * item
            continue
        mult = step * item
        for a in reversed(axes):
            out[a] = mult
            mult *= ext[a]
    return out


class _Cache:
    """One bound cache as the kernel sees it: its leaves' addresses and one leaf's axis strides."""

    __slots__ = ("binding", "ptrs", "base", "strides", "ls")

    def __init__(self, binding: Any, tree: Any, m: LayoutMap, g: Geometry, ext: dict[str, int]):
        tensors = leaves(tree)
        first = tensors[0]
        if any(t.stride() != first.stride() for t in tensors[1:]):
            raise Unsupported("cache tensors differ in strides")
        self.binding = binding  # held so that id(binding) is not reused while this entry lives
        self.ptrs = array.array("Q", [t.data_ptr() for t in tensors])
        self.base = self.ptrs.buffer_info()[0]
        self.strides = _strides(m.paged.dims, first, ext, g.N is None)
        self.ls: dict[str, int] = {}
        step = 1
        for a in reversed(m.paged.lists):
            self.ls[a] = step
            step *= ext[a]


_caches: dict[int, _Cache] = {}
_CACHES_KEPT = 8


def _cache_of(binding: Any, tree: Any, m: LayoutMap, g: Geometry, ext: dict[str, int]) -> _Cache:
    """Per binding (immutable, one per cache fingerprint: leaf addresses, shapes, strides),
    so every tree a call brings with that binding has these leaves; without one, per call."""
    found = _caches.get(id(binding)) if binding is not None else None
    if found is None or found.binding is not binding:
        found = _Cache(binding, tree, m, g, ext)
        if binding is not None:
            with _lock:
                if len(_caches) >= _CACHES_KEPT:
                    _caches.pop(next(iter(_caches)))
                _caches[id(binding)] = found
    return found


def _address(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    if t.dtype != torch.int64 or not t.is_contiguous():
        raise Unsupported("index tensors must be contiguous int64")
    return t.data_ptr()


class Call:
    """One kernel call of a chunk: its dims (flat, FIELDS per dim), run bytes and object byte offset."""

    __slots__ = ("dims", "nd", "run", "ooff")

    def __init__(self, dims: list[list[int]], run: int, ooff: int):
        self.dims = array.array("q", [v for d in dims for v in d])
        self.nd, self.run, self.ooff = len(dims), run, ooff


class Description:
    """The kernel calls that move one chunk between a cache and objects of one shape and
    strides (any layer of a layerwise connector: the layer is an offset added per call)."""

    __slots__ = ("key", "ck", "cache", "calls")

    def __init__(self, key: tuple[Any, ...], ck: Chunk, cache: _Cache, calls: list[Call]):
        self.key, self.ck, self.cache, self.calls = key, ck, cache, calls


#: The last description, reused while the same chunk moves layer after layer. It holds its
#: chunk and cache binding, so the ids in its key cannot be reused by other objects meanwhile.
_last: list[Description] = []


def describe(m: LayoutMap, store: bool, tensor: torch.Tensor, kvcaches: Any, g: Geometry, ck: Chunk,
             binding: Any = None) -> Description:
    """The kernel calls that move `ck`: its block path and its token path."""
    key = (id(m), store, id(ck), id(binding), tensor.shape, tensor.stride(), tensor.element_size())
    found = _last[0] if _last else None
    if found is not None and binding is not None and found.key == key and found.ck is ck \
            and found.cache.binding is binding:
        return found
    ext = g.extents()
    cache = _cache_of(binding, kvcaches, m, g, ext)
    cs, ls = cache.strides, cache.ls
    ext_t = {**ext, "T": ck.num_tokens}
    os_ = _strides(m.obj.dims, tensor, ext_t, False)
    item = tensor.element_size()
    if tensor.element_size() != g.dtype.itemsize:
        raise Unsupported("object and cache elements differ in size")
    plain: list[list[int]] = []
    for a in m.shared:
        n = ext.get(a, 1)
        if n == 1:
            continue
        if (a not in cs and a not in ls) or a not in os_:
            raise Unsupported(f"axis {a} is on one side only")
        plain.append([n, 0, 0, 1, cs.get(a, 0), 0, 0, os_[a], ls.get(a, 0)])
    folded = g.N is None
    if "T" not in os_ or (folded and "S" not in cs) or (not folded and ("B" not in cs or "N" not in cs)):
        raise Unsupported("token axes not found")
    os_t = os_["T"]
    parts = []
    if ck.has_blocks and not folded:
        ids = ck.block_ids
        n = int(g.N)  # type: ignore[arg-type]
        blocks = [ck.block_tokens // n, _address(ids) if isinstance(ids, torch.Tensor) else 0,
                  ids.start if isinstance(ids, slice) else 0, 1, cs["B"], 0, 0, n * os_t, 0]
        within = [n, 0, 0, 1, cs["N"], 0, 0, os_t, 0]
        parts.append(([blocks, within, *plain], ck.block_start * os_t))
    if ck.has_tokens:
        slots = ck.slots
        count = slots.stop - slots.start if isinstance(slots, slice) else slots.numel()  # type: ignore[union-attr]
        sl = [0, slots.start] if isinstance(slots, slice) else [_address(slots), 0]  # type: ignore[union-attr]
        if folded:
            tok = [count, *sl, 1, cs["S"], 0, _address(ck.tok), os_t, 0]
        else:
            tok = [count, *sl, int(g.N), cs["B"], cs["N"], _address(ck.tok), os_t, 0]  # type: ignore[arg-type]
        parts.append(([tok, *plain], 0))
    calls = []
    for dims, ooff in parts:
        run, dims = _order(dims, store, item)
        if len(dims) > MAX_DIMS:
            raise Unsupported(f"{len(dims)} dims exceed the kernel's {MAX_DIMS}")
        calls.append(Call(dims, run, ooff))
    found = Description(key, ck, cache, calls)
    if binding is not None:
        _last[:] = [found]
    return found


def _order(dims: list[list[int]], store: bool, item: int) -> tuple[int, list[list[int]]]:
    """Dims outermost first in the destination's order (so it is written front to back),
    then the innermost dims both sides keep contiguous merged into the run."""
    if store:
        dims = sorted(dims, key=lambda d: -d[7])
    else:  # the cache: other leaves first, then its byte strides
        dims = sorted(dims, key=lambda d: (-d[8], -d[4]))
    run = item
    while dims:
        d = dims[-1]
        if d[1] or d[2] or d[3] != 1 or d[6] or d[8] or d[4] != run or d[7] != run:
            break
        run *= d[0]
        dims.pop()
    return run, dims


def move(m: LayoutMap, store: bool, layer: int | None, tensor: torch.Tensor, kvcaches: Any, g: Geometry,
         ck: Chunk, threads: int, binding: Any = None, stream: bool = False) -> None:
    """Move one chunk (of one layer when `layer` is given) with the compiled kernel, with
    streaming stores when `stream`. Unsupported (before anything is written) when it cannot."""
    if not ck.has_blocks and not ck.has_tokens:
        return
    lib = library()
    if lib is None:
        raise Unsupported(_state["why"])
    d = describe(m, store, tensor, kvcaches, g, ck, binding)
    leaf0, coff0 = 0, 0
    if layer is not None:  # one layer of a per-layer object: L is fixed
        if "L" in d.cache.ls:
            leaf0 = layer * d.cache.ls["L"]  # one layer of a cache whose layers are leaves starts at that leaf
        else:
            coff0 = layer * d.cache.strides.get("L", 0)
    obj = tensor.data_ptr()
    for c in d.calls:
        stats["calls"] += 1
        if lib.kvgen_move(int(store), c.nd, c.dims.buffer_info()[0], c.run, d.cache.base + 8 * leaf0, coff0,
                          obj + c.ooff, threads, int(stream)) != 0:
            raise Unsupported("the kernel refused the description")
