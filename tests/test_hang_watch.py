"""A test that runs too long has every thread's stack printed, once, while it still runs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from hang_watch import HangWatch


def _read_all(fd: int) -> str:
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


def test_a_test_past_its_time_has_every_threads_stack_printed_once() -> None:
    read, write = os.pipe()
    parked = threading.Event()
    helper = threading.Thread(target=parked.wait, name="a-helper-thread", daemon=True)
    helper.start()
    watch = HangWatch(after=0.1, fd=write, poll=0.01)
    try:
        watch.begin("tests/test_x.py::test_stuck")
        time.sleep(0.3)  # three times its time: printed once all the same
        watch.end()
    finally:
        watch.stop()
        parked.set()
    out = _read_all(read)
    assert out.count("+++ tests/test_x.py::test_stuck has run for 0.1 s") == 1, out
    assert "test_a_test_past_its_time_has_every_threads_stack_printed_once" in out  # the stuck thread's frame
    assert out.count("hread 0x") >= 3  # this one, the helper and the watch itself (its "Current thread")


def test_tests_that_end_in_time_print_nothing() -> None:
    read, write = os.pipe()
    watch = HangWatch(after=0.1, fd=write, poll=0.01)
    try:
        for i in range(10):
            watch.begin(f"tests/test_x.py::test_quick[{i}]")
            time.sleep(0.02)
            watch.end()
        time.sleep(0.15)  # nothing running: nothing to print
    finally:
        watch.stop()
    assert _read_all(read) == ""


def test_pytest_prints_the_stack_of_a_test_past_hang_dump_after(tmp_path: Path) -> None:
    """Through pytest, as the plugin this folder's conftest loads: the stack shows up in the run's
    output while the test is still running, not only in its captured output after it."""
    (tmp_path / "test_sleeps.py").write_text("import time\n\ndef test_sleeps():\n    time.sleep(0.6)\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "hang_watch",
                           "-o", "hang_dump_after=0.2", "--rootdir", str(tmp_path), "-c", os.devnull,
                           str(tmp_path / "test_sleeps.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent),
                               "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "test_sleeps.py::test_sleeps has run for 0.2 s" in done.stderr, done.stderr
    assert 'File "' in done.stderr and "test_sleeps" in done.stderr
