"""kvgen's drop-in connectors inside LMCache 0.5.6's real cache engine on the CPU
(LMCacheEngineBuilder.get_or_create, post_init, store / retrieve, store_layer /
retrieve_layer): each case stores, wipes the cache, retrieves and compares bit for bit
(tests/lmcache_engine.py). The engine runs in a child process because LMCache leaves
threads running that would keep pytest from exiting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="lmcache 0.5.6 is not installed (scripts/dev test installs it)")

# Under pytest-xdist one worker runs this file, so the engine subprocess is made once (conftest.py).
pytestmark = pytest.mark.xdist_group("lmcache_engine")

SCRIPT = Path(__file__).with_name("lmcache_engine.py")
CASES = ["store-retrieve", "prefix-hit", "vllm-cached-tokens", "layerwise", "mla", "sglang"]


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    done = subprocess.run([sys.executable, str(SCRIPT), *CASES], capture_output=True, text=True, timeout=240)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("ok ", "FAIL ", "skip:", "done"))]
    if lines and lines[0].startswith("skip:"):
        pytest.skip(lines[0][len("skip: "):])
    assert lines and lines[-1] == "done", \
        f"the engine run did not finish (rc {done.returncode}):\n{done.stderr[-3000:]}"
    return {line.split()[1].rstrip(":"): line for line in lines[:-1]}


@pytest.mark.parametrize("case", CASES)
def test_lmcache_engine_round_trip(results: dict[str, str], case: str) -> None:
    assert results.get(case) == f"ok {case}", results.get(case, f"{case} did not run")
