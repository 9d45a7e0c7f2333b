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
from pathlib import Path

import pytest
from forked import run_forked
from harness import need_lmcache

need_lmcache()

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("lmcache_engine.py")
from kvgen.oracle.facts.vllm import KV_CACHE_LAYOUTS  # noqa: E402

CASES = ["store-retrieve", "prefix-hit", "vllm-cached-tokens", "layerwise", "mla", "sglang"]
#: vLLM 0.33's KVCacheLayouts, run in the same engine process when vllm is installed.
VLLM033 = [f"vllm033-{layout}" for layout in KV_CACHE_LAYOUTS]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


#: What the engine run imports, imported here first so that the forked child shares it.
ENGINE_IMPORTS = ("lmcache.v1.cache_engine", "lmcache.v1.config", "lmcache.v1.metadata", "kvgen.integrations.lmcache",
                  "vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning", "vllm.v1.worker.utils")


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
