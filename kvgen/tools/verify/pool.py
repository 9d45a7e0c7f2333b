"""`kvgen verify --jobs N`: the rows of verify (one connector, transfer or model connector on
one device) checked by N worker processes, printed in the same order as one process prints
them.

Why processes: the reference and the connectors' torch paths run mostly in Python, so one
process keeps one core busy; the rows are independent. Workers are not forks of verify's own
process, whose torch may have started its OpenMP team, but forks of a fork server that imports
torch and verify's modules once (kvgen.tools.processes). Each worker loads the library
and the package itself, once, and gets rows by index into the same planned lists (planning is
deterministic), so nothing but indices and results crosses the process boundary.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgen.plan.models import plan_models
from kvgen.plan.package import plan_connectors
from kvgen.spec.library import load_library
from kvgen.spec.transfers import load_transfers
from kvgen.tools.packages import import_package
from kvgen.tools.processes import worker_context
from kvgen.tools.verify.heap import keep_freed_memory

#: Rows of each kind, as `(kind, index into the planned list, device)`.
Task = tuple[str, int, str]


@dataclass(frozen=True)
class Inputs:
    """What a worker needs to rebuild the lists the rows index: the package's folder, the spec
    folders and the copy backend (None: each connector's own choice)."""

    out: Path
    specs: tuple[Path, ...]
    backend: str | None


@dataclass
class Context:
    """One process's library, plans and package (made once per worker, or by main for --jobs 1)."""

    inputs: Inputs
    library: Any
    plans: list[Any]
    transfers: list[Any]
    models: list[Any]
    package: Any


def load(inputs: Inputs) -> Context:
    """The library of `inputs`, its plans and the package (refused when it does not import)."""
    library = load_library(list(inputs.specs))
    plans = plan_connectors(library)
    return Context(inputs, library, plans, load_transfers(library, list(inputs.specs)),
                   plan_models(library, plans)[0], import_package(inputs.out))


#: How a row is checked: (context, task) -> its result; a module-level function, which a
#: spawned worker imports by name.
Check = Callable[[Context, Task], tuple[bool, ...]]

_worker: dict[str, Any] = {}


def _start(inputs: Inputs, check: Check, threads: int) -> None:
    import torch  # torch: only in a worker, which checks rows

    keep_freed_memory()
    torch.set_num_threads(threads)  # N workers share the cores instead of each taking all of them
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent.sentinel,), daemon=True).start()
    _worker["ctx"], _worker["check"] = load(inputs), check


#: What the fork server imports before it forks a worker (kvgen.tools.processes): torch, and the
#: module of the row checks, which imports every kind's checks and the library's stages.
WORKER_PRELOAD = ("torch", "kvgen.tools.verify.run")


def _exit_with(sentinel: int) -> None:
    """End this worker once verify's process is gone (killed, say): a pool's workers would
    otherwise wait for rows forever."""
    multiprocessing.connection.wait([sentinel])
    os._exit(1)


def _run(task: Task) -> tuple[bool, ...]:
    return _worker["check"](_worker["ctx"], task)


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


#: Memory one worker may need: DeepSeek-V4's model rows (2432-token scenarios through 43
#: layers, its float32 state caches sized for every token) peak at about 7 GiB in the worker
#: that checks them.
WORKER_MEMORY = 8 << 30


def memory() -> int | None:
    """This machine's memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def default_jobs() -> int:
    """One worker per core, at most 4 (each worker imports torch and the package), and at most
    one per WORKER_MEMORY of the machine's memory."""
    total = memory()
    by_memory = 4 if total is None else total // WORKER_MEMORY
    return max(1, min(4, cores(), by_memory))


class Rows:
    """Checks rows with `check` in this process (jobs 1) or in a pool of spawned workers, in order."""

    def __init__(self, ctx: Context, jobs: int, check: Check):
        self.ctx, self.jobs, self.check = ctx, jobs, check
        self._pool: ProcessPoolExecutor | None = None
        self._futures: dict[Task, Future[tuple[bool, ...]]] = {}

    def __enter__(self) -> Rows:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def submit(self, tasks: Sequence[Task], cost: Callable[[Task], int] | None = None) -> None:
        """Hand `tasks` to the workers now, so that they run while this process does other work
        (map returns their results later); nothing with jobs 1. With `cost` (a row's expected
        work) workers take the costliest rows first, so a long row never starts last while the
        other workers have nothing left to do."""
        if self.jobs <= 1 or (self._pool is None and len(tasks) <= 1):
            return  # one row: checked in this process, without starting a pool
        if self._pool is None:
            threads = max(1, cores() // self.jobs)
            self._pool = ProcessPoolExecutor(self.jobs, mp_context=worker_context(WORKER_PRELOAD),
                                             initializer=_start, initargs=(self.ctx.inputs, self.check, threads))
        new = [t for t in tasks if t not in self._futures]
        # sorted() is stable: rows of equal cost (every row, without `cost`) keep their order
        for task in sorted(new, key=lambda t: -cost(t)) if cost else new:
            self._futures[task] = self._pool.submit(_run, task)

    def map(self, tasks: Sequence[Task], cost: Callable[[Task], int] | None = None) -> Iterator[tuple[bool, ...]]:
        """The results of `tasks`, in their order, each as soon as it and those before it are done
        (submitted now, as `submit` does, where they were not before)."""
        self.submit(tasks, cost)
        if any(t not in self._futures for t in tasks):
            return (self.check(self.ctx, t) for t in tasks)
        return (self._futures[t].result() for t in tasks)


def tasks_of(kind: str, items: Sequence[Any], everything: Sequence[Any], devices: Sequence[str]) -> list[Task]:
    """The rows of the selected `items` of a kind on every device, devices outermost; an item
    is named by its index in `everything`, the kind's whole planned list."""
    where: Callable[[Any], int] = {id(x): i for i, x in enumerate(everything)}.__getitem__
    return [(kind, where(id(item)), device) for device in devices for item in items]


def by_cost(everything: Sequence[Any], cost: Callable[[Any], int] | None) -> Callable[[Task], int] | None:
    """A task's expected work from its item's (`cost`), or None."""
    return None if cost is None else (lambda task: cost(everything[task[1]]))


def each(rows: Rows, kind: str, items: Sequence[Any], everything: Sequence[Any], devices: Sequence[str],
         cost: Callable[[Any], int] | None = None) -> Iterator[tuple[Any, str, tuple[bool, ...]]]:
    """(item, device, result) for every selected item on every device, devices outermost; `cost`
    (an item's expected work) hands the costliest rows to the workers first (Rows.map)."""
    pairs = [(item, device) for device in devices for item in items]
    results = rows.map(tasks_of(kind, items, everything, devices), by_cost(everything, cost))
    for (item, device), result in zip(pairs, results, strict=True):
        yield item, device, result
