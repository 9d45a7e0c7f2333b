"""kvgen's drop-in connectors inside LMCache 0.5.6's real cache engine on the CPU
(LMCacheEngineBuilder.get_or_create, post_init, store / retrieve, store_layer /
retrieve_layer): each case stores, wipes the cache, retrieves and compares bit for bit
(tests/lmcache_engine.py). With vllm 0.33.0 installed, the same engine process also takes vLLM
0.33's per-layer views of every KVCacheLayout (made by vLLM's create_kv_cache_views), the layout
named by LMCache's layout_hints. The engine runs in a child process because LMCache leaves
threads running that would keep pytest from exiting."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from harness import need_lmcache

need_lmcache()

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("lmcache_engine.py")
from kvgen.oracle.facts.vllm import KV_CACHE_LAYOUTS  # noqa: E402

CASES = ["store-retrieve", "prefix-hit", "vllm-cached-tokens", "layerwise", "mla", "sglang"]
#: vLLM 0.33's KVCacheLayouts, run in the same engine process when vllm is installed.
VLLM033 = [f"vllm033-{layout}" for layout in KV_CACHE_LAYOUTS]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    cases = CASES + (VLLM033 if HAS_VLLM else [])
    done = subprocess.run([sys.executable, str(SCRIPT), *cases], capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("ok ", "FAIL ", "skip:", "done"))]
    if lines and lines[0].startswith("skip:"):
        pytest.skip(lines[0][len("skip: "):])
    assert lines and lines[-1] == "done", \
        f"the engine run did not finish (rc {done.returncode}):\n{done.stderr[-3000:]}"
    return {line.split()[1].rstrip(":"): line for line in lines[:-1]}


@pytest.mark.parametrize("case", CASES)
def test_lmcache_engine_round_trip(results: dict[str, str], case: str) -> None:
    assert results.get(case) == f"ok {case}", results.get(case, f"{case} did not run")


@pytest.mark.skipif(not HAS_VLLM, reason="vllm 0.33.0 is not installed (scripts/dev installs it unless "
                    "KVGEN_NO_ENGINES=1)")
@pytest.mark.parametrize("case", VLLM033)
def test_lmcache_engine_takes_vllm_033_views_named_by_layout_hints(results: dict[str, str], case: str) -> None:
    assert results.get(case) == f"ok {case}", results.get(case, f"{case} did not run")
