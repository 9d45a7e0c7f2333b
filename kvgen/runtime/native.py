"""The compiled CPU kernel (csrc/kvcopy.c): compiling, loading and sharing torch's thread team.
One C call moves a whole chunk (or one layer of it) between a paged cache and a memory
object, with memcpy over the longest runs both sides keep contiguous (a whole block at once
where the layouts allow); kvgen.runtime.movers.native turns a connector's PROGRAM into those
calls, kvgen.runtime.transfer.compiled a transfer's pairs.

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

The copy is driven by the connector's planned description (PROGRAM: which tensor dim holds
which axis) and the actual strides of the cache leaves and the object, so one kernel serves
every connector of a one-tree cache; the planes of a format-2 cache move in one walk where
their dims agree (kvgen_move_planes), a model's state rows in one call (kvgen_copy_rows), and
a chunk's slot facts and a load's repeated-slot check are read in one pass (kvgen_slots,
kvgen_repeated_slot).
"""


from __future__ import annotations

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

from kvgen.runtime import host
from kvgen.runtime.host import cache_dir, compiler, missing_compiler
from kvgen.runtime.movers.base import Unsupported

#: Unsupported is the movers' one refusal, named here for the callers of this module.
__all__ = ["ABI", "FIELDS", "FLAGS", "MAX_DIMS", "MAX_PLANES", "Unsupported", "library", "reset", "stats", "team",
           "unavailable"]

#: Compiler flags; part of the cache key. No -march=native: the cache may be shared by hosts
#: of one user, and glibc's memcpy already picks the widest vector unit at run time.
FLAGS = ("-O2", "-shared", "-fPIC", "-pthread", "-std=c99")
#: The kernel's calling convention (kvgen_abi() in csrc/kvcopy.c).
ABI = 5
#: Int64 fields per dim (csrc/kvcopy.c) and the most dims it takes.
FIELDS, MAX_DIMS = 11, 8
#: The most planes kvgen_move_planes walks together (KV_MAXP in csrc/kvcopy.c).
MAX_PLANES = 4

_lock = threading.Lock()
_state: dict[str, Any] = {}
#: Kernel calls so far (tests use it to see that the compiled path, not torch, moved the data).
stats = {"calls": 0, "fallbacks": 0}


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
    lib.kvgen_move_planes.restype = ctypes.c_int
    lib.kvgen_move_planes.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.kvgen_copy_rows.restype = ctypes.c_int
    lib.kvgen_copy_rows.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.kvgen_slots.restype = None
    lib.kvgen_slots.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.kvgen_repeated_slot.restype = ctypes.c_int64
    lib.kvgen_repeated_slot.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
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
    """Forget the loaded library (tests switch compilers)."""
    with _lock:
        _state.clear()
