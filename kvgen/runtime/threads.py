"""How many intra-op threads the CPU torch path takes for one chunk's ops: a busy host (a
co-located engine on every core) runs them on one thread, since each op's parallel region
ends in a barrier that waits for descheduled threads."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import torch

from kvgen.runtime.errors import KVGenError

#: A torch op on the CPU that moves fewer bytes runs on one thread: waking threads and the
#: barrier at the end of a parallel region cost more than they save.
PARALLEL_BYTES = 4 << 20
#: The same for the compiled kernel on torch's OpenMP team, whose workers are spinning or
#: a futex wake away (tens of microseconds, against ~150 us for one thread to copy 1 MiB).
TEAM_PARALLEL_BYTES = 256 << 10
_CPUS = os.cpu_count() or 1


def runnable() -> int | None:
    """Threads of other processes ready to run on this host now: Linux's /proc/loadavg count
    less this process's own running threads (torch's pool threads spin a while after each
    parallel region, and must not make an idle host look busy)."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            ready = int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None
    return max(ready - _own_running(), 0)


def _own_running() -> int:
    """This process's threads in state R (running or ready), from /proc/self/task."""
    count = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                # the state follows the command name, which is in parentheses and may hold spaces
                count += f.read().rpartition(b")")[2].split()[0] == b"R"
        except (OSError, IndexError):
            continue
    return max(count, 1)


#: How long one reading of the host's runnable threads stands: reading /proc costs about
#: 0.1 ms, which a layerwise connector would otherwise pay once per layer.
SAMPLE_SECONDS = 0.05
_sample: list[float | int | None] = [float("-inf"), None]


def _others() -> int | None:
    """runnable(), read again once SAMPLE_SECONDS have passed since the last reading."""
    now = time.monotonic()
    if now - _sample[0] >= SAMPLE_SECONDS:  # type: ignore[operator]
        _sample[:] = [now, runnable()]
    return _sample[1]  # type: ignore[return-value]


def cpu_threads(op_bytes: int, parallel_bytes: int = PARALLEL_BYTES) -> int:
    """Intra-op threads for the torch ops of one chunk on the CPU, each moving `op_bytes`.

    A connector issues one or more ops per layer, each a parallel region whose closing
    barrier waits for all its threads; on a host whose cores are all taken (a co-located
    engine), some are descheduled and every barrier waits a scheduling slice, so the cost
    grows with the number of ops. Small ops and a busy host run on one thread, which never
    waits; KVGEN_CPU_THREADS=N fixes the count (fixed_threads())."""
    fixed = fixed_threads()
    if fixed is not None:
        return fixed
    have = torch.get_num_threads()
    if have <= 1 or op_bytes < parallel_bytes:
        return 1
    others = _others()
    # Every core taken by other processes (this thread needs one too): one thread.
    return 1 if others is not None and others + 1 > _CPUS else have


def fixed_threads() -> int | None:
    """The count KVGEN_CPU_THREADS fixes (None: unset), capped at this host's CPUs: more
    threads than CPUs gain nothing, and an OpenMP team of a million threads crashes the
    process. A value that is no whole number from 1 is refused, not ignored."""
    text = os.environ.get("KVGEN_CPU_THREADS", "").strip()
    if not text:
        return None
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise KVGenError(f"KVGEN_CPU_THREADS must be a whole number of threads, 1 or more (at most {_CPUS} are "
                         f"used here, this host's CPUs), got {text!r}; unset it to let kvgen choose")
    return min(int(text), _CPUS)


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to `n` for the block, then restored."""
    old = torch.get_num_threads()
    if n == old:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
