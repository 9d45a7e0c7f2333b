"""A script run in a fork of the test process: what the process imported already (torch, Triton,
LMCache, vLLM) the child has too, where a fresh interpreter spends seconds importing it again.

For scripts that need nothing fresh: LMCache's engine (which leaves threads behind, so it runs in
a process of its own), the GPU bench on CPU tensors. The child never returns into pytest.
"""

from __future__ import annotations

import os
import runpy
import select
import signal
import sys
import time
import traceback
from pathlib import Path

TIMEOUT = 300


def one_thread_for_torch() -> None:
    """A forked child runs torch's ops on one thread: it keeps the parent's OpenMP team but not the
    team's threads, so its first parallel region (a large fill, say) would wait for them forever
    where the parent had used more than one (a plain `pytest` run, not xdist's one-thread workers)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def run_forked(script: Path, args: list[str], log: Path, timeout: float = TIMEOUT) -> tuple[str, int | None]:
    """`script` run as __main__ with `args` in a forked child: (its stdout, its exit status; None
    when it ran past `timeout` seconds and was killed), as a process running the script would end:
    0 at its end, n at sys.exit(n), 70 at an exception, whose traceback goes to `log` with the rest
    of its stderr."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 70
        try:
            os.close(read)
            one_thread_for_torch()
            sys.stdout = os.fdopen(write, "w")
            os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
            sys.stderr = os.fdopen(2, "w")
            sys.argv = [str(script), *args]
            runpy.run_path(str(script), run_name="__main__")
            status = 0
        except SystemExit as end:  # sys.exit(n), as a script's process would end
            status = end.code if isinstance(end.code, int) else int(end.code is not None)
        except BaseException:  # noqa: BLE001 - whatever ends the child is shown, never raised into pytest
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    os.close(write)
    out, deadline = bytearray(), time.monotonic() + timeout
    with os.fdopen(read, "rb", buffering=0) as pipe:
        while (left := deadline - time.monotonic()) > 0 and select.select([pipe], [], [], left)[0]:
            chunk = pipe.read(65536)
            if not chunk:
                break
            out += chunk
    if time.monotonic() >= deadline:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return out.decode(), None
    return out.decode(), os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
