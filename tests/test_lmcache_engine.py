"""kvgen's drop-in connectors inside LMCache 0.5.6's real cache engine on the CPU
(LMCacheEngineBuilder.get_or_create, post_init, store / retrieve, store_layer /
retrieve_layer): each case stores, wipes the cache, retrieves and compares bit for bit
(tests/lmcache_engine.py). With vllm 0.33.0 installed, the same engine run also takes vLLM
0.33's per-layer views of every KVCacheLayout (made by vLLM's create_kv_cache_views), the layout
named by LMCache's layout_hints.

The engine runs in a child process because LMCache leaves threads running that would keep pytest
from exiting: a fork of this test process, which has imported torch, LMCache and (on the worker
of the vLLM tests, where this module runs) vLLM already. A fresh interpreter spent 7.5 s of its
8.4 s importing them."""

from __future__ import annotations

import importlib
import importlib.util
import os
import runpy
import select
import signal
import sys
import time
import traceback
from pathlib import Path

import pytest
from harness import VLLM_GROUP, need_lmcache

need_lmcache()

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(VLLM_GROUP)]

SCRIPT = Path(__file__).with_name("lmcache_engine.py")
from kvgen.oracle.facts.vllm import KV_CACHE_LAYOUTS  # noqa: E402

CASES = ["store-retrieve", "prefix-hit", "vllm-cached-tokens", "layerwise", "mla", "sglang"]
#: vLLM 0.33's KVCacheLayouts, run in the same engine process when vllm is installed.
VLLM033 = [f"vllm033-{layout}" for layout in KV_CACHE_LAYOUTS]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


#: What the engine run imports, imported here first so that the forked child shares it.
ENGINE_IMPORTS = ("lmcache.v1.cache_engine", "lmcache.v1.config", "lmcache.v1.metadata", "kvgen.integrations.lmcache",
                  "vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning", "vllm.v1.worker.utils")
TIMEOUT = 300


def run_forked(script: Path, args: list[str], log: Path, timeout: float = TIMEOUT) -> tuple[str, int | None]:
    """`script` run as __main__ with `args` in a forked child: (its stdout, its exit status; None
    when it ran past `timeout` seconds and was killed). Its stderr goes to `log`; an exception that
    ends it is written there and exits 70."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read)
            sys.stdout = os.fdopen(write, "w")
            os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
            sys.stderr = os.fdopen(2, "w")
            sys.argv = [str(script), *args]
            runpy.run_path(str(script), run_name="__main__")  # ends the process itself (os._exit)
        except BaseException:  # noqa: BLE001 - whatever ends the child is shown, never raised into pytest
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(70)
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


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cases = CASES + (VLLM033 if HAS_VLLM else [])
    for name in ENGINE_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the child imports it again and says why (skip: ...), or goes without vLLM's
            pass
    log = tmp_path_factory.mktemp("lmcache-engine") / "stderr.txt"
    out, status = run_forked(SCRIPT, cases, log)
    lines = [line for line in out.splitlines() if line.startswith(("ok ", "FAIL ", "skip:", "done"))]
    if lines and lines[0].startswith("skip:"):
        pytest.skip(lines[0][len("skip: "):])
    assert lines and lines[-1] == "done", \
        f"the engine run did not finish (exit {status}):\n{log.read_text(errors='replace')[-3000:]}"
    return {line.split()[1].rstrip(":"): line for line in lines[:-1]}


@pytest.mark.parametrize("case", CASES)
def test_lmcache_engine_round_trip(results: dict[str, str], case: str) -> None:
    assert results.get(case) == f"ok {case}", results.get(case, f"{case} did not run")


@pytest.mark.skipif(not HAS_VLLM, reason="vllm 0.33.0 is not installed (scripts/dev installs it unless "
                    "KVGEN_NO_ENGINES=1)")
@pytest.mark.parametrize("case", VLLM033)
def test_lmcache_engine_takes_vllm_033_views_named_by_layout_hints(results: dict[str, str], case: str) -> None:
    assert results.get(case) == f"ok {case}", results.get(case, f"{case} did not run")


def test_a_child_that_fails_shows_why_and_one_that_hangs_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text("import sys, time\nprint('ok one', flush=True)\nif sys.argv[1] == 'fail':\n"
                      "    raise RuntimeError('the engine broke')\ntime.sleep(60)\n")
    out, status = run_forked(script, ["fail"], tmp_path / "fail.txt")
    assert (out, status) == ("ok one\n", 70)
    assert "RuntimeError: the engine broke" in (tmp_path / "fail.txt").read_text()
    start = time.monotonic()
    out, status = run_forked(script, ["hang"], tmp_path / "hang.txt", timeout=0.5)
    assert (out, status) == ("ok one\n", None) and time.monotonic() - start < 10
