"""`kvgen build` and `kvgen check`: render a library and write it in one step, or compare.

A build renders everything in memory, then, holding a lock beside the output, writes it
into a staging folder beside the output and swaps the two folders. Whenever a build stops,
even by SIGKILL, the output is the complete old or the complete new package:

- On Linux the swap is one `renameat2(RENAME_EXCHANGE)` call; the staging name then holds
  the old package, which is deleted. A first build (no output yet) is one plain rename.
- Where the exchange is unavailable (another OS, a filesystem or kernel that refuses it),
  the old package is renamed to a backup `.NAME.old-*`, the new one renamed in, the backup
  deleted. A kill between the two renames leaves no output but the whole old package in the
  backup; every build, check and `recover` first puts such a backup back.
- Concurrent builds of one output take turns on an `flock` of `.NAME.lock` beside it (never
  inside it, so neither check nor packaging sees it). The lock holder knows nobody else is
  writing, so it removes what killed builds left: `.NAME.new-*` staging folders and backups.

Two environment variables exist for the tests only: KVGEN_TESTHOOK_BUILD_PAUSE (seconds to
sleep at each step, so a test's SIGKILL can land between any two) and
KVGEN_TESTHOOK_NO_EXCHANGE (force the fallback).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from kvgen.emit.render import as_built, render_package
from kvgen.errors import BuildError, display_path
from kvgen.plan.package import plan_package
from kvgen.spec.library import data_dir, load_library
from kvgen.spec.transfers import load_transfers

try:
    import fcntl
except ImportError:  # not on Windows: builds there are not serialized
    fcntl = None  # type: ignore[assignment]

DEFAULT_OUT = data_dir("generated")
_IGNORED = {"__pycache__"}

PAUSE_HOOK = "KVGEN_TESTHOOK_BUILD_PAUSE"
NO_EXCHANGE_HOOK = "KVGEN_TESTHOOK_NO_EXCHANGE"


def render(extra_specs: Sequence[Path] = (), *, builtin: bool = True) -> dict[str, str]:
    library = load_library(extra_specs, builtin=builtin)
    transfers = load_transfers(library, extra_specs, builtin=builtin)
    return render_package(plan_package(library, transfers))


def _pause() -> None:
    """Test hook: sleep between steps so that a test's kill can land in every window."""
    delay = os.environ.get(PAUSE_HOOK)
    if delay:
        time.sleep(float(delay))


# -- one-step exchange of two paths ---------------------------------------------------------

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_LIBC_WRAPPER = "renameat2"  # glibc >= 2.28; older ones need the raw syscall
# renameat2's number per machine, for syscall(2) where libc has no wrapper
_SYSCALLS = {"x86_64": 316, "amd64": 316, "i386": 353, "i686": 353, "aarch64": 276, "arm64": 276,
             "riscv64": 276, "loongarch64": 276, "armv7l": 382, "armv6l": 382, "ppc64le": 357, "ppc64": 357,
             "s390x": 347}
# errors meaning "this system cannot exchange", as opposed to a real failure
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}

Renameat2 = Callable[[bytes, bytes, int], int]  # (old, new, flags) -> 0 or an errno
_renameat2_cached: Renameat2 | None = None


def _syscall_number() -> int | None:
    return _SYSCALLS.get(platform.machine().lower()) if sys.platform.startswith("linux") else None


def _renameat2() -> Renameat2 | None:
    """renameat2 through libc's wrapper or syscall(2); None where neither is available."""
    global _renameat2_cached
    if _renameat2_cached is not None or not sys.platform.startswith("linux"):
        return _renameat2_cached
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    wrapper = getattr(libc, _LIBC_WRAPPER, None)
    number = _syscall_number()
    if wrapper is not None:
        wrapper.restype = ctypes.c_int
        wrapper.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]

        def call(a: bytes, b: bytes, flags: int) -> int:
            return 0 if wrapper(_AT_FDCWD, a, _AT_FDCWD, b, flags) == 0 else ctypes.get_errno()
    elif number is not None and hasattr(libc, "syscall"):
        syscall = libc.syscall
        syscall.restype = ctypes.c_long

        def call(a: bytes, b: bytes, flags: int) -> int:
            # syscall(2) is variadic and reads every argument as a long
            rc = syscall(ctypes.c_long(number), ctypes.c_long(_AT_FDCWD), ctypes.c_char_p(a),
                         ctypes.c_long(_AT_FDCWD), ctypes.c_char_p(b), ctypes.c_long(flags))
            return 0 if rc == 0 else ctypes.get_errno()
    else:
        return None
    _renameat2_cached = call
    return call


def _exchange(a: Path, b: Path) -> bool:
    """Swap what paths `a` and `b` name in one atomic step; False where the system cannot."""
    if os.environ.get(NO_EXCHANGE_HOOK):
        return False
    call = _renameat2()
    if call is None:
        return False
    err = call(os.fsencode(a), os.fsencode(b), _RENAME_EXCHANGE)
    if err == 0:
        return True
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


# -- the lock and what killed builds leave --------------------------------------------------


def _sibling(out: Path, kind: str) -> Path:
    """A fresh name beside `out`; backups sort by creation time, so recovery takes the newest."""
    stamp = f"{time.time_ns():020d}-{os.getpid()}" if kind == "old" else f"{os.getpid()}-{secrets.token_hex(4)}"
    return out.parent / f".{out.name}.{kind}-{stamp}"


class _Lock:
    """An exclusive flock on `.NAME.lock` beside `out`, held across a build's writes.

    The file is unlinked while still locked, so none is left behind; a process that opened
    the old file meanwhile sees that the name now points elsewhere (or nowhere) and retries.
    """

    def __init__(self, out: Path, *, required: bool) -> None:
        self.path = out.parent / f".{out.name}.lock"
        self.required = required
        self.fd: int | None = None

    def __enter__(self) -> bool:
        if fcntl is None:
            return False
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            except OSError as exc:
                if self.required:
                    raise BuildError(f"cannot create lock file {display_path(self.path)}: {exc.strerror}") from None
                return False  # a read-only place: nobody can be building there through us
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                mine = os.fstat(fd)
                now = os.stat(self.path)
                same = (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)
            except FileNotFoundError:
                same = False
            except BaseException:
                os.close(fd)
                raise
            if same:
                self.fd = fd
                return True
            os.close(fd)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.fd is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None


def _debris(out: Path) -> tuple[list[Path], list[Path]]:
    """Staging folders and backups beside `out`, backups oldest first."""
    if not out.parent.is_dir():
        return [], []
    new, old = f".{out.name}.new-", f".{out.name}.old-"
    names = sorted(p.name for p in out.parent.iterdir())
    return ([out.parent / n for n in names if n.startswith(new)],
            [out.parent / n for n in names if n.startswith(old)])


def _recover_locked(out: Path) -> None:
    staging, backups = _debris(out)
    if backups and not os.path.lexists(out):
        # a fallback build was killed between its renames: its backup is the whole old output
        try:
            os.rename(backups.pop(), out)
        except OSError as exc:
            raise BuildError(f"cannot restore {display_path(out)} from a killed build's backup: {exc}") from None
    for path in staging + backups:
        shutil.rmtree(path, ignore_errors=True)


def recover(out: Path) -> None:
    """Finish what a killed build left beside `out`: put back the output it had moved aside,
    remove its staging and backup folders. Build and check do this first themselves."""
    out = Path(out).resolve()
    with _Lock(out, required=False) as held:
        if held:
            _recover_locked(out)


# -- build ----------------------------------------------------------------------------------


def _swap(staging: Path, out: Path) -> Path | None:
    """Put `staging` in place of `out` atomically; returns the path now holding the old output."""
    if not os.path.lexists(out):
        os.rename(staging, out)
        return None
    if _exchange(staging, out):
        return staging
    backup = _sibling(out, "old")
    os.rename(out, backup)
    _pause()  # the window a kill would leave without `out`, until recovery
    try:
        os.rename(staging, out)
    except BaseException:
        os.rename(backup, out)
        raise
    return backup


def write_atomically(out: Path, files: dict[str, str]) -> None:
    """Replace folder `out` with exactly `files` in one step; on any failure, or a kill, the
    old folder stays. Raises BuildError for what the file system refuses."""
    out = Path(out).resolve()
    shown = display_path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"cannot create {display_path(out.parent)}: {exc.strerror}") from None
    if os.path.lexists(out) and not out.is_dir():
        raise BuildError(f"{shown} exists and is not a folder")
    with _Lock(out, required=True):
        _pause()
        _recover_locked(out)
        staging = _sibling(out, "new")
        try:
            staging.mkdir()
            for name, text in files.items():
                (staging / name).write_text(text, encoding="utf-8")
            _pause()
            old = _swap(staging, out)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise BuildError(f"cannot write {shown}: {exc}; the previous output is unchanged") from None
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _pause()
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        _pause()


def build(out: Path = DEFAULT_OUT, extra_specs: Sequence[Path] = (), *, builtin: bool = True) -> dict[str, str]:
    files = render(extra_specs, builtin=builtin)
    write_atomically(out, files)
    return files


# -- check ----------------------------------------------------------------------------------


@dataclass
class CheckReport:
    stale: list[str] = field(default_factory=list)
    edited: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    stray: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.stale or self.edited or self.missing or self.stray)

    def lines(self) -> list[str]:
        out = [f"edited by hand: {n}" for n in self.edited]
        out += [f"out of date (specs or templates changed): {n}" for n in self.stale]
        out += [f"missing: {n}" for n in self.missing]
        out += [f"stray file, not written by kvgen build: {n}" for n in self.stray]
        return out


def check(out: Path = DEFAULT_OUT, extra_specs: Sequence[Path] = (), *, builtin: bool = True) -> CheckReport:
    """Compare `out` with what `build` would write there (after recovering a killed build)."""
    expected = render(extra_specs, builtin=builtin)
    out = Path(out)
    # under the lock a concurrent build cannot swap the folder while it is being read
    with _Lock(out.resolve(), required=False) as held:
        if held:
            _recover_locked(out.resolve())
        return _compare(out, expected)


def _compare(out: Path, expected: dict[str, str]) -> CheckReport:
    report = CheckReport()
    if not out.is_dir():
        report.missing = sorted(expected)
        return report
    present = {p.name for p in out.iterdir() if p.name not in _IGNORED}
    report.missing = sorted(set(expected) - present)
    report.stray = sorted(present - set(expected))
    for name in sorted(set(expected) & present):
        path = out / name
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise BuildError(f"cannot read {path}: {exc}") from None
        if text == expected[name]:
            continue
        (report.stale if as_built(text) is not None else report.edited).append(name)
    return report
