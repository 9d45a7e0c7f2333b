"""What the compiled CPU path asks of its host: a build folder no one else can write, which
chunks it writes with streaming stores, and the OpenMP runtime torch runs its intra-op
threads on (whose threads the kernel shares)."""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
from pathlib import Path

import torch


def compiler() -> str | None:
    """The C compiler to use: KVGEN_CC, else the first of cc, gcc, clang on PATH."""
    wanted = os.environ.get("KVGEN_CC")
    if wanted is not None:
        return shutil.which(wanted) if wanted else None
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def cache_dir() -> Path:
    explicit = os.environ.get("KVGEN_CACHE_DIR")
    if explicit:
        return Path(explicit) / "native"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvgen" / "native"


def missing_compiler() -> str:
    """Why compiler() found none, in the user's terms."""
    wanted = os.environ.get("KVGEN_CC")
    return f"KVGEN_CC={wanted}: no such compiler on PATH" if wanted else \
        "no C compiler found (install cc/gcc or set KVGEN_CC)"


def switched_off(variable: str) -> bool:
    """Whether an on/off environment switch of the compiled path (on when unset) says off."""
    return os.environ.get(variable, "1") in ("0", "", "off", "no")


class UnsafeFolder(OSError):
    """A build folder or library another user could have written: never loaded from."""


def private_folder(path: Path) -> Path:
    """`path`, created with mode 0700 where missing; UnsafeFolder when it is no folder, is not
    owned by this process's user, or is writable by its group or others. A library loaded
    from there runs inside this process: one another user could plant or replace must not be."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFolder(f"the kernel's build folder {path} is not a folder")
    _refuse_foreign(path, st, "build folder")
    return path


def check_library(path: Path) -> None:
    """UnsafeFolder unless `path` is a regular file (no link) owned by this process's user and
    writable by no one else: checked before every load of a compiled kernel."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFolder(f"refusing to load {path}: not a regular file")
    _refuse_foreign(path, st, "library")


def _refuse_foreign(path: Path, st: os.stat_result, what: str) -> None:
    uid = os.getuid()
    if st.st_uid != uid:
        raise UnsafeFolder(f"refusing the kernel's {what} {path}: it is owned by uid {st.st_uid}, not by this "
                           f"process's user (uid {uid}); remove it or set KVGEN_CACHE_DIR to a folder of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeFolder(f"refusing the kernel's {what} {path}: its group or others may write it (mode "
                           f"{stat.S_IMODE(st.st_mode):o}); `chmod go-w` it or set KVGEN_CACHE_DIR")


#: A chunk of at least this many bytes is written with streaming stores (csrc/kvcopy.c).
STREAM_BYTES = 8 << 20


def streams(chunk_bytes: int) -> bool:
    """Whether a chunk of `chunk_bytes` (all its layers, also when a layerwise connector
    moves them one call at a time) is written with streaming stores. A plain store first
    reads each destination line, a third memory transfer per byte, and evicts what the
    engine is working on for data nobody reads back soon. Measured with
    benchmarks/native_choices.py (2 vCPUs): on torch's team streamed stores match or beat
    plain ones at 32 MiB and 256 MiB."""
    return chunk_bytes >= STREAM_BYTES


#: Entry points of an OpenMP runtime (GNU's ABI, which LLVM's and Intel's runtimes also export).
_OPENMP_ENTRIES = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")


def torch_openmp() -> str | None:
    """Path of the OpenMP runtime torch runs its intra-op threads on in this process, when
    there is exactly one candidate: one inside torch's own folder, else the only one loaded."""
    if not torch._C.has_openmp:
        return None
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            mapped = {line.split(None, 5)[-1].strip() for line in f if "omp" in line}
    except OSError:
        return None
    runtimes = sorted(p for p in mapped if os.path.basename(p).startswith(("libgomp", "libiomp", "libomp")))
    own = [p for p in runtimes if p.startswith(os.path.dirname(torch.__file__) + os.sep)]
    found = own or runtimes
    return found[0] if len(found) == 1 else None


def openmp_entries(path: str) -> tuple[int, int, int] | None:
    """Addresses of _OPENMP_ENTRIES in the runtime at `path`, which must be loaded already
    (never a second copy of it); None when one is missing."""
    try:
        runtime = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        found = [ctypes.cast(getattr(runtime, name), ctypes.c_void_p).value for name in _OPENMP_ENTRIES]
    except (OSError, AttributeError):
        return None
    if not all(found):
        return None
    return found[0], found[1], found[2]  # type: ignore[return-value]
