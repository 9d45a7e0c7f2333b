"""Shared fixtures: the device every connector test runs on; the serial tests.

KVGEN_TEST_DEVICES=cpu,cuda picks devices; by default CPU plus every CUDA / XPU device
present. A device that is asked for but absent is skipped, never silently replaced.

Tests marked `serial` measure time, count threads or start CPU-heavy neighbours: a test
running beside them on another worker would change what they see. `scripts/dev test` runs
the others in parallel (pytest-xdist) and then these alone. Under a plain `pytest -n N`
the modules that hold them run on one worker, one after another.

Under xdist a worker is handed whole scopes: a test module, or the modules of SHARED_SCOPES
that share a costly import, so that every module fixture (a build, NIXL agents, a rendered
library) is made once, and the controller sends one message per scope instead of one per
test; scopes with a `slow` test go first, then the others largest first, so that no long
module is left for the end while the other worker idles. The scopes are read off the test ids
by kvgen's own scheduler (xdist's `loadgroup` marks ids with their group, which pytest 9.2's
structured ids drop silently: pytest-xdist #1386).
"""

from __future__ import annotations

import atexit
import fnmatch
import functools
import gc
import importlib.util
import os
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

# torch and kvgen are imported where a hook of a process that runs tests needs them: xdist's
# controller runs none, and importing them cost it 1.8 s of CPU beside its workers.


def _devices() -> list[str]:
    from kvgen.runtime import available_devices

    asked = os.environ.get("KVGEN_TEST_DEVICES")
    return [d.strip() for d in asked.split(",") if d.strip()] if asked else available_devices()


#: The serial pass's marker expression (scripts/dev test: `-m serial`).
SERIAL_MARKEXPR = "serial"

#: A test running past the ini setting hang_dump_after (seconds) has every thread's stack printed.
pytest_plugins = ("hang_watch",)


def use_triton_interpreter() -> None:
    """Where no GPU is present, every Triton kernel a test runs, kvgen's and an engine's (SGLang's
    MXFP8 store kernel, vLLM's ROCm writer), runs in Triton's interpreter. triton.jit reads
    TRITON_INTERPRET when a kernel is defined, which for SGLang is when its memory pools are
    imported, at collection: so it is set when the session is configured, before any test module
    is imported. A test that needs it otherwise sets it (monkeypatch)."""
    from kvgen.runtime import available_devices

    if available_devices() == ["cpu"] and importlib.util.find_spec("triton") is not None:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def runs_tests(config: pytest.Config) -> bool:
    """Whether this process runs tests: not with --collect-only, nor as pytest-xdist's controller,
    which hands them to its workers."""
    if config.option.collectonly:
        return False
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) or not getattr(config.option, "numprocesses", None)


def pytest_configure(config: pytest.Config) -> None:
    if runs_tests(config):
        use_triton_interpreter()
        # The tests run Triton kernels in its interpreter as verify does: without its 32-bit overflow
        # checks and its repeated patches of triton.language (kvgen.tools.verify.interpreter).
        from kvgen.tools.verify.interpreter import quicken

        quicken()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        one_thread_per_worker()
        atexit.register(end_worker_at_once)
    collect_garbage_once(config)
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", None) == "load":
        config.option.loadscopereorder = False  # the workers put the scopes in order (in_dispatch_order)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: pytest without xdist never calls it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """For xdist's default distribution (`load`, what `-n` gives): whole scopes (scope_of) to a
    worker at a time, where xdist's `load` hands out single tests. Another `--dist` is xdist's."""
    if config.option.dist != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return ScopeScheduling(config, log)


#: Where the test ids' paths start (pytest's rootdir: the folder of pyproject.toml).
ROOT = Path(__file__).resolve().parent.parent


#: Test modules (file-name patterns) whose tests run on one worker, by the scope's name: each
#: loads something that costs seconds in a process, so that only one worker pays for it.
SHARED_SCOPES = {
    # vLLM's own cache code (about 7 s of CPU to import); LMCache's engine, in a fork of the
    # worker, builds its caches with it
    "vllm": ("test_engine_vllm*.py", "test_lmcache_engine.py", "test_lmcache_vllm033.py",
             "test_remote_vllm_canonical.py"),
    # every module of the package parsed (code_rules.source_tree: about 3 MB, 2-3 s), once
    "source_trees": ("test_architecture.py", "test_devices.py"),
}
#: The one way a test becomes serial: the marker, written in its module.
SERIAL_MARK = "mark.serial"
#: The scope of the modules that hold a serial test (under a plain `pytest -n N`: one worker).
SERIAL_SCOPE = "serial"


def scope_of(nodeid: str) -> str:
    """What one worker runs whole: the test module's shared scope, SERIAL_SCOPE for a module
    that holds a serial test, else the module."""
    return module_scope(nodeid.split("::", 1)[0])


@functools.cache
def module_scope(module: str) -> str:
    """scope_of for the test module at `module` (a path from ROOT, as test ids give it)."""
    name = PurePosixPath(module).name
    shared = next((scope for scope, patterns in SHARED_SCOPES.items()
                   if any(fnmatch.fnmatchcase(name, p) for p in patterns)), None)
    return shared or (SERIAL_SCOPE if holds_serial_tests(ROOT / module) else module)


@functools.cache
def holds_serial_tests(path: Path) -> bool:
    """Whether the test module at `path` marks a test serial (by its text, as the serial pass
    selects its modules: pytest_ignore_collect)."""
    return path.suffix == ".py" and path.is_file() and SERIAL_MARK in path.read_text(encoding="utf-8")


def one_thread_per_worker() -> None:
    """Parallel workers share the cores, so each worker's torch (and every process its tests
    start) runs one thread. With torch's default of one thread per core, every small op of one
    worker waited in an OpenMP barrier for threads the other worker's tests kept descheduled:
    tests of many small ops took 2-8 times as long. Tests of the kernels' thread split ask
    for their threads (cpu_threads patched); the serial pass keeps torch's default.

    For the same reason a `kvgen verify` run by a test sees one core, so it checks its rows in
    the test's own process: by default it spawned a worker per core, each importing torch and
    the package (2 s of CPU a worker) for a few rows. The tests of the worker pool ask for it
    (`--jobs 2`)."""
    import torch

    from kvgen.tools.verify import pool as verify_pool

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    verify_pool.cores = lambda: 1


def end_worker_at_once() -> None:
    """An xdist worker ends without tearing its interpreter down. By the time it exits it has
    reported every test to the controller, which waits for it: tearing down the heap that thousands
    of tests built (torch, Triton's interpreter, NIXL, the generated package) took 4-5 s of C-level
    finalization a worker, after the last test, while the run waited. Every other process the
    suite starts (the serial pass, the CLI, verify's workers) still finalizes in full. Registered
    first, this runs last of the handlers registered during the run (atexit runs them in reverse)
    and ahead of those registered before the tests were configured, which a worker does not need:
    its output is flushed here."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def collect_garbage_once(config: pytest.Config) -> None:
    """pytest ends a session by collecting garbage five times over, so that an exception raised
    where nothing could catch it (in a __del__, a finalizer) is reported: on a worker's heap
    (torch, vLLM, LMCache, Triton's interpreter, the generated package) that took 3.6-4.4 s after
    its last test, while the run waited (and 0.9 s in the controller). Each process collects once:
    the objects it finds are those the tests left unreachable, and their finalizers report as
    before."""
    try:
        from _pytest.unraisableexception import gc_collect_iterations_key
    except ImportError:  # a pytest without the setting collects as it does
        return
    config.stash[gc_collect_iterations_key] = 1


def pytest_collection_finish(session: pytest.Session) -> None:
    keep_the_collected_heap_out_of_gc()


#: The cyclic collector's thresholds while tests run (Python's: 700, 10, 10).
GC_THRESHOLDS = (20_000, 20, 20)


def keep_the_collected_heap_out_of_gc() -> None:
    """What importing and collecting built (torch, the engines, the generated package, thousands
    of test items: millions of objects) lives until the process ends, yet each of the ~25 full
    passes of the cyclic collector in a worker walked all of it again, 0.2-0.4 s a pass: with
    the gen-0 and gen-1 passes, a tenth of the workers' time went to the collector. Frozen
    (gc.freeze), the collector leaves those objects alone; what the tests allocate is still
    collected, in fewer, larger passes. Measured by gc.callbacks over the parallel pass: 20 s
    of collection in the two workers before, 9-12 s after."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The serial pass (`-m serial`, scripts/dev test) imports only the modules that mark a test
    serial: collecting every module (torch, vLLM, the library at import) cost that pass more
    CPU time than its tests. None: pytest's own rules decide (never False, which would
    override them)."""
    if config.getoption("markexpr", "") != SERIAL_MARKEXPR or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_") or holds_serial_tests(collection_path):
        return None
    return True


# A wrapper: the items are ordered after every other plugin has selected them.
@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Any:
    result = yield
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items[:] = in_dispatch_order(items)
    return result


def in_dispatch_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """The items scope by scope, in the order the controller hands the scopes out: scopes with a
    `slow` test first (a few tests of seconds each: processes, builds, an engine's import), then
    the others by their number of tests, largest first; within a scope, the collection order.
    Every worker computes the same order from the same collection, as xdist requires."""
    tests: dict[str, int] = {}
    slow: set[str] = set()
    for item in items:
        scope = scope_of(item.nodeid)
        tests[scope] = tests.get(scope, 0) + 1
        if item.get_closest_marker("slow") is not None:
            slow.add(scope)
    first_seen = {scope: i for i, scope in enumerate(tests)}
    rank = {scope: (scope not in slow, -n, first_seen[scope]) for scope, n in tests.items()}
    return sorted(items, key=lambda item: rank[scope_of(item.nodeid)])


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", _devices(), indirect=True)


@pytest.fixture
def device(request: pytest.FixtureRequest) -> str:
    from kvgen.runtime import available_devices

    if request.param not in available_devices():
        pytest.skip(f"device {request.param} is not available here")
    return request.param


@pytest.fixture(params=["native", "torch"])
def copy_backend(request: pytest.FixtureRequest) -> str:
    """The copy path of a transfer test: the compiled CPU kernel, then the generated torch
    copies (the fallback and readable reference); each runs the same checks."""
    from kvgen.runtime import native

    if request.param == "native" and native.unavailable():
        pytest.skip(f"the compiled kernel cannot run here: {native.unavailable()}")
    return request.param
