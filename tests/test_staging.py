"""use_gpu: copies gather into one reusable staging tensor on the cache's device, then make
one copy to or from the object. Checked against the reference, not against the direct path:
every scenario in turn through one connector, so the staging tensor is reused across chunks
of other sizes and still holds the previous transfer's bytes when a -1 token must keep the
object's own."""

from __future__ import annotations

import pytest
from harness import SCENARIOS, builtin_library

from kvgen import generated
from kvgen.oracle.scenarios import check_connector

LIB = builtin_library()
MODULES = ["vllm_flash_attn_hnd__kv_2ltd", "sglang_mha__kv_t2d", "vllm_cross_layer__kv_2td", "vllm_mla__kv_mla_layer"]


@pytest.mark.parametrize("module", MODULES)
def test_staging_buffer_matches_reference(module: str) -> None:
    paged, obj = module.split("__")
    names = list(SCENARIOS)
    results = check_connector(generated, LIB[paged], LIB[obj], "cpu", [SCENARIOS[n] for n in names], use_gpu=True)
    wrong = [(n, r) for n, r in zip(names, results, strict=True) if r != (True, True)]
    assert not wrong, f"(store ok, load ok) differ from the reference with use_gpu: {wrong}"
