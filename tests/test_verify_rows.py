"""How `kvgen verify` runs its rows: the costliest handed to the workers first, results printed in
order; its processes keep the memory they free, so the reference's large caches are not
page-faulted afresh at every allocation."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import Future
from typing import Any

import pytest
from harness import builtin_library

from kvgen.plan.package import plan_package
from kvgen.tools.verify import models as verify_models
from kvgen.tools.verify import pool
from kvgen.tools.verify.pool import Rows, Task


class _Recorder:
    """A stand-in worker pool: records the order rows are submitted in, answers at once."""

    def __init__(self) -> None:
        self.submitted: list[int] = []

    def submit(self, fn: Any, task: Task) -> Future[tuple[bool, ...]]:
        self.submitted.append(task[1])
        done: Future[tuple[bool, ...]] = Future()
        done.set_result((task[1] % 2 == 0,))
        return done

    def shutdown(self, **kwargs: Any) -> None:
        pass


def test_the_costliest_rows_start_first_and_results_keep_their_order() -> None:
    rows = Rows(None, 2, lambda ctx, task: (True,))  # type: ignore[arg-type]
    rows._pool = _Recorder()  # type: ignore[assignment]
    tasks = [("model", i, "cpu") for i in range(5)]
    cost = {3: 100, 1: 50}
    results = list(rows.map(tasks, lambda task: cost.get(task[1], 1)))
    assert rows._pool.submitted == [3, 1, 0, 2, 4]  # type: ignore[attr-defined]
    assert results == [(True,), (False,), (True,), (False,), (True,)]


def test_rows_handed_over_early_run_once_and_map_returns_their_results() -> None:
    rows = Rows(None, 2, lambda ctx, task: (True,))  # type: ignore[arg-type]
    rows._pool = _Recorder()  # type: ignore[assignment]
    models = [("model", i, "cpu") for i in range(3)]
    rows.submit(models, lambda task: 10 if task[1] == 2 else 1)
    rows.submit([("connector", 7, "cpu")])
    assert rows._pool.submitted == [2, 0, 1, 7]  # type: ignore[attr-defined]
    assert list(rows.map(models)) == [(True,), (False,), (True,)]
    assert list(rows.map([("connector", 7, "cpu")])) == [(False,)]
    assert rows._pool.submitted == [2, 0, 1, 7]  # type: ignore[attr-defined]


def test_verify_hands_every_row_to_the_workers_before_its_own_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in specs' checks (vLLM's import among them: seconds of one core) run in verify's
    own process while the workers check rows, costliest model rows first."""
    from kvgen.tools.cli import main
    from kvgen.tools.verify import connectors, engines, transfers
    from kvgen.tools.verify import run as verify

    calls: list[Any] = []

    def submit(self: Rows, tasks: list[Task], cost: Any = None) -> None:
        kinds = {kind for kind, _, _ in tasks}
        calls.append(("submit", kinds, cost is not None))

    monkeypatch.setattr(Rows, "submit", submit)
    monkeypatch.setattr(verify, "_check_facts", lambda library: calls.append("facts") or 0)
    monkeypatch.setattr(engines, "run", lambda: calls.append("engines") or 0)
    monkeypatch.setattr(connectors, "run", lambda *args: calls.append("connector table") or 0)
    monkeypatch.setattr(transfers, "run", lambda *args: calls.append("transfer table") or (0, 0))
    monkeypatch.setattr(verify_models, "run", lambda *args: calls.append("model table") or (0, 0))
    assert main(["verify", "--device", "cpu", "--jobs", "2"]) == 0
    assert calls == [("submit", {"connector"}, False), ("submit", {"transfer"}, False), ("submit", {"model"}, True),
                     "facts", "engines", "connector table", "transfer table", "model table"]


def test_deepseek_v4_rows_are_the_costliest_model_rows() -> None:
    """128 tokens per compressed slot make each of its scenarios move 128x the tokens."""
    plans = plan_package(builtin_library()).models
    costliest = max(verify_models.expected_work(p) for p in plans)
    assert {p.model.name for p in plans if verify_models.expected_work(p) == costliest} == {"deepseek_v4_flash"}
    assert all(verify_models.expected_work(p) < costliest / 10 for p in plans if p.model.name != "deepseek_v4_flash")


#: A process that frees and allocates 64 MiB blocks (as the reference frees and allocates caches)
#: and prints how many pages it faulted in meanwhile.
_FAULTS = """
import resource, sys
from kvgen.tools.verify.heap import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
block = bytearray(64 << 20)
del block
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    block = bytearray(64 << 20)
    del block
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's (Linux)")
def test_a_freed_block_is_reused_without_faulting_its_pages_again() -> None:
    pages = 4 * (64 << 20) // 4096
    applied, plain = _faults("plain")
    assert applied == "None" and plain > pages // 2  # each block mapped and faulted afresh
    applied, kept = _faults("keep")
    assert applied == "True" and kept < pages // 100


@pytest.mark.parametrize(("cores", "gib", "jobs"), [
    (2, 24, 2), (8, 64, 4), (4, 16, 2), (4, 12, 1), (16, 4, 1), (1, 64, 1), (8, None, 4),
])
def test_default_workers_fit_the_cores_and_the_memory(monkeypatch: pytest.MonkeyPatch, cores: int,
                                                     gib: int | None, jobs: int) -> None:
    """A worker checking DeepSeek-V4's model rows peaks at about 7 GiB: one worker per core, at
    most 4, and at most one per 8 GiB."""
    monkeypatch.setattr(pool, "cores", lambda: cores)
    monkeypatch.setattr(pool, "memory", lambda: None if gib is None else gib << 30)
    assert pool.default_jobs() == jobs
