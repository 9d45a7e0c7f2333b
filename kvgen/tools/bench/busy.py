"""`kvgen bench --busy`: a neighbour process that keeps every core busy with torch work, as a
co-located inference engine does, while the figures are taken.

A host that serves models is never idle. Each torch op with OpenMP threads ends in a barrier
that waits for all of its threads, and on a busy host one of them is often descheduled, so
a connector's cost grows with the number of ops it issues rather than with its bytes; the
plain copy it is compared with issues one. The neighbour runs matrix products on as many
threads as there are cores until it is stopped.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

_NEIGHBOUR = """
import os, sys, torch
torch.set_num_threads(os.cpu_count() or 1)
a = torch.randn(512, 512)
b = torch.randn(512, 512)
print("ready", flush=True)
while True:
    a = torch.mm(a, b).clamp_(-1, 1)
"""


@contextlib.contextmanager
def neighbour() -> Iterator[int]:
    """Run the busy neighbour for the duration of the block; yields its pid."""
    proc = subprocess.Popen([sys.executable, "-c", _NEIGHBOUR], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1)})
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the busy neighbour did not start (exit status {proc.poll()})")
        yield proc.pid
    finally:
        proc.kill()  # only this process, which this function started
        proc.wait(timeout=30)
