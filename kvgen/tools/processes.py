"""How kvgen's commands start worker processes (`verify --jobs`, `pd`'s prefill and decode).

Not as forks of the command's own process: a forked child of a process whose torch started its
OpenMP team hangs in its first parallel region. They are forked from a fork server, a fresh
process that imports what the workers need once and runs nothing, where a spawned worker spends
about 2 s of CPU importing torch and kvgen's modules itself; where the platform has no fork
server, they are spawned.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
from collections.abc import Sequence


def worker_context(preload: Sequence[str]) -> multiprocessing.context.BaseContext:
    """A multiprocessing context whose processes are forked from a fork server that imported the
    modules `preload` (it never runs a torch op, so it has no OpenMP team to lose), else spawned.
    One process has one fork server: the preload of the first context that starts it holds, and
    a worker imports anything else it needs itself."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    return context
