"""The CPU torch path's thread choice (few parallel regions on a busy host) and the busy
neighbour of `kvgen bench --busy`."""

from __future__ import annotations

import os
import time

import pytest
import torch
from harness import SCENARIOS, builtin_library

from kvgen import generated
from kvgen.errors import KVGenError
from kvgen.oracle.scenarios import check_connector
from kvgen.runtime import threads
from kvgen.runtime.movers import torch as torch_mover
from kvgen.tools.bench.busy import neighbour

# Thread counts that depend on how busy the host is: run alone (conftest.py).
pytestmark = pytest.mark.serial

MB = 1 << 20
LIBRARY = builtin_library()


def test_small_ops_and_a_busy_host_run_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVGEN_CPU_THREADS", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(threads, "_CPUS", 4)
    monkeypatch.setattr(threads, "SAMPLE_SECONDS", 0.0)  # every call reads the host again
    monkeypatch.setattr(threads, "runnable", lambda: 2)
    assert threads.cpu_threads(64 * MB) == 4
    assert threads.cpu_threads(threads.PARALLEL_BYTES - 1) == 1
    monkeypatch.setattr(threads, "runnable", lambda: 5)  # more ready threads than cores
    assert threads.cpu_threads(64 * MB) == 1
    monkeypatch.setattr(threads, "runnable", lambda: None)  # no /proc/loadavg: keep torch's count
    assert threads.cpu_threads(64 * MB) == 4
    monkeypatch.setenv("KVGEN_CPU_THREADS", "3")
    assert threads.cpu_threads(1) == 3


def test_a_reading_of_the_host_stands_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layerwise connectors ask once per layer; /proc is read once per SAMPLE_SECONDS."""
    reads: list[int] = []
    monkeypatch.setattr(threads, "_sample", [float("-inf"), None])
    monkeypatch.setattr(threads, "runnable", lambda: reads.append(1) or 0)
    monkeypatch.setattr(threads, "SAMPLE_SECONDS", 3600.0)
    for _ in range(5):
        threads._others()
    assert len(reads) == 1
    monkeypatch.setattr(threads, "SAMPLE_SECONDS", 0.0)
    threads._others()
    assert len(reads) == 2


def test_runnable_counts_the_threads_of_a_busy_neighbour_which_is_stopped_after() -> None:
    """One neighbour (a process importing torch: a second of this serial pass) serves both checks."""
    assert threads._own_running() >= 1  # this thread is running, and is not counted
    counted = threads.runnable() is not None  # where the host has /proc/loadavg
    seen = []
    with neighbour() as pid:
        os.kill(pid, 0)  # alive
        for _ in range(50 if counted else 0):  # the neighbour's threads show within a few scheduler ticks
            seen.append(threads.runnable())
            if seen[-1]:
                break
            time.sleep(0.05)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    if not counted:
        pytest.skip("no /proc/loadavg on this host: the neighbour ran and was stopped, its threads not counted")
    assert seen[-1] and seen[-1] >= 1, seen


def test_torch_path_runs_with_the_chosen_threads_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    monkeypatch.setattr(torch_mover, "cpu_threads", lambda op_bytes: seen.append(op_bytes) or 1)
    cls = generated.get("vllm_flash_attn_nhd", "kv_2ltd")
    store = cls._store
    during: list[int] = []

    def spy(self: object, *args: object) -> None:
        during.append(torch.get_num_threads())
        store(self, *args)

    monkeypatch.setattr(cls, "_store", spy)
    before = torch.get_num_threads()
    paged, obj = LIBRARY["vllm_flash_attn_nhd"], LIBRARY["kv_2ltd"]
    assert check_connector(generated, paged, obj, "cpu", [SCENARIOS["partial_blocks"]],
                           backend="torch") == [(True, True)]
    assert during and set(during) == {1}
    assert seen and torch.get_num_threads() == before


def test_a_fixed_count_is_capped_at_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVGEN_CPU_THREADS=1000000 once reached torch.set_num_threads and crashed the process."""
    monkeypatch.setattr(threads, "_CPUS", 4)
    monkeypatch.setenv("KVGEN_CPU_THREADS", "1000000")
    assert threads.cpu_threads(1) == 4
    monkeypatch.setenv("KVGEN_CPU_THREADS", "4")
    assert threads.cpu_threads(1) == 4


def test_a_huge_fixed_count_runs_parallel_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """An op large enough to run in parallel, on the count the torch path sets for a chunk."""
    monkeypatch.setenv("KVGEN_CPU_THREADS", "1000000")
    x = torch.arange(1 << 22, dtype=torch.float32)
    with threads.intra_op_threads(threads.cpu_threads(x.numel() * x.element_size())):
        y = x + 1
    assert torch.equal(y - 1, x)


@pytest.mark.parametrize("value", ["0", "-2", "many", "2.5", "³"])
def test_a_count_that_is_no_whole_number_is_refused(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGEN_CPU_THREADS", value)
    with pytest.raises(KVGenError, match=f"KVGEN_CPU_THREADS must be a whole number of threads, 1 or more .*got "
                                         f"'{value}'"):
        threads.cpu_threads(64 * MB)
