"""Property test (hypothesis): random grouped models, written as spec files, built into a test
package and checked both ways against the reference (kvgen.oracle.reference.models).

Each model has one or two attention groups, each in a random layout (simple ones with K/V
and heads, MLA, and format-2 caches of several parts) with random H, C and block size, and
maybe a state group of one or two tensors of random shape and dtype; layers go to groups at
random (a state group takes the others)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml
from harness import builtin_library
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from model_harness import build_models

from kvgen.oracle.scenarios import models as ms

#: Layouts whose lists start with L, with the sizes a group may declare for them.
LAYOUTS = {
    "vllm_flash_attn_nhd": ("H", "C", "N"),
    "vllm_flash_attn_hnd": ("H", "C", "N"),
    "vllm_flashinfer_hnd": ("H", "C"),
    "vllm_mla": ("C",),
    "vllm_fp8_tensor_scales": ("H", "C.kv"),
    "vllm_gaudi_fp8": ("H",),
}
BASE = builtin_library()


@st.composite
def models(draw: Any) -> dict[str, Any]:
    layers = draw(st.integers(2, 6))
    groups = draw(st.integers(1, 2))
    with_state = draw(st.booleans()) and layers > groups
    owner = [draw(st.integers(0, groups - 1 + with_state)) for _ in range(layers)]
    for g in range(groups + with_state):  # every group and the state get a layer
        if g not in owner:
            owner[draw(st.sampled_from([i for i in range(layers) if owner.count(owner[i]) > 1]))] = g
    spec: dict[str, Any] = {"kvgen": 2, "name": "random_model", "kind": "model", "summary": "random",
                            "layers": layers, "groups": {}}
    for g in range(groups):
        layout = draw(st.sampled_from(sorted(LAYOUTS)))
        sizes = {}
        for key in LAYOUTS[layout]:
            if key == "N":
                if draw(st.booleans()):
                    sizes["N"] = draw(st.sampled_from([2, 4]))
            else:
                sizes[key] = draw(st.integers(1, 3)) if key == "H" else draw(st.sampled_from([2, 4, 6]))
        spec["groups"][f"g{g}"] = {"layout": layout, "layers": [i for i in range(layers) if owner[i] == g],
                                   "sizes": sizes}
    if with_state:
        tensors = []
        for j in range(draw(st.integers(1, 2))):
            shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
            dtype = draw(st.sampled_from(["float32", "bfloat16", "int8"]))
            tensors.append({"name": f"t{j}", "shape": shape, "dtypes": [dtype]})
        spec["state"] = {"s": {"layers": "others", "tensors": tensors}}
    return spec


#: Found by this test: blocks of 2 slots need more blocks than the default to hold a sequence.
SMALL_BLOCKS = {"kvgen": 2, "name": "random_model", "kind": "model", "summary": "random", "layers": 2,
                "groups": {"g0": {"layout": "vllm_flash_attn_hnd", "layers": [0, 1],
                                  "sizes": {"H": 1, "C": 2, "N": 2}}}}


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=models(), scenario=st.sampled_from(sorted(ms.SCENARIOS)))
@example(spec=SMALL_BLOCKS, scenario="sliding_window_chunks")
def test_random_grouped_models_match_reference(spec: dict[str, Any], scenario: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "specs"
        folder.mkdir()
        (folder / "random_model.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        toys = build_models(Path(tmp) / "out", [folder])
        lib = toys.library
        for plan in toys.plans:
            result = ms.check_model(toys, lib, lib.model("random_model"), plan.obj, ms.SCENARIOS[scenario])
            assert result == (True, True), (plan.obj.name, spec)
        assert {p.obj.name for p in toys.plans} == {"kv_groups", "kv_groups_attention"}, toys.skipped
