"""A test that hangs shows where: every thread's stack is printed once the test has run a set time.

pytest's own `faulthandler_timeout` arms faulthandler's timer around every test, and each arming
starts a thread that the test's end joins again: 0.15-0.45 ms a test, seconds of CPU over the
suite's 7000 tests. Here one thread per test process looks at the running test every few
seconds; a test only stores its id and start time.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Generator

import pytest


class HangWatch:
    """Writes every thread's stack to `fd` once a test has run `after` seconds (within `poll`)."""

    def __init__(self, after: float, fd: int, poll: float | None = None) -> None:
        self.after = after
        self.fd = fd
        self.poll = poll if poll is not None else min(5.0, after / 10)
        self.running: tuple[str, float] | None = None  # (test id, time.monotonic() at its start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvgen-hang-watch", daemon=True)
        self._thread.start()

    def begin(self, test: str) -> None:
        self.running = (test, time.monotonic())

    def end(self) -> None:
        self.running = None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        shown = None
        while not self._stop.wait(self.poll):
            running = self.running  # one read: the test may end meanwhile
            if running is None or running is shown or time.monotonic() - running[1] < self.after:
                continue
            os.write(self.fd, f"\n+++ {running[0]} has run for {self.after:g} s; the stack of every "
                              f"thread of process {os.getpid()}:\n".encode())
            faulthandler.dump_traceback(file=self.fd, all_threads=True)
            shown = running


# -- as a pytest plugin (tests/conftest.py loads it; `-p hang_watch` elsewhere) --------------------

HANG_DUMP_AFTER = "hang_dump_after"
_WATCH = pytest.StashKey[HangWatch]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(HANG_DUMP_AFTER, "print every thread's stack once a test has run this many seconds "
                  "(0: never; scripts/dev sets 600)", default="0")


def pytest_configure(config: pytest.Config) -> None:
    """The stacks go to the process's own stderr (a copy of it taken before any test's capture),
    so they show while the test still runs; under xdist, a worker's stderr is the run's."""
    after = float(config.getini(HANG_DUMP_AFTER))
    if after > 0:
        config.stash[_WATCH] = HangWatch(after, os.dup(sys.__stderr__.fileno()))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    watch = item.config.stash.get(_WATCH, None)
    if watch is None:
        return (yield)
    watch.begin(item.nodeid)
    try:
        return (yield)
    finally:
        watch.end()
