"""`kvgen verify --backend triton` on the CPU runs each connector's kernel in Triton's
interpreter (every program instance in Python) on the slot scenarios whose launches take a
kernel path no earlier scenario took: found by a rehearsal, in which the connector plans and
launches and the launches run nothing.

These tests pin what that choice may and may not leave out: a rehearsal writes nothing and
counts no launch; every scenario left out launches only paths a chosen one launched; and a
kernel fault confined to one path (here: objects off a 16-byte boundary) still fails.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import builtin_plans

from kvgen import generated
from kvgen.oracle.scenarios import (
    SCENARIOS,
    clone_tree,
    connector_load,
    connector_store,
    make_cache,
    make_objects,
    move_pair,
    obj_tensors,
    same_bits,
)
from kvgen.runtime import available_devices, kernels
from kvgen.tools.verify import connectors as verify_connectors

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or available_devices() != ["cpu"],
    reason="needs triton, and a machine without a GPU (Triton's interpreter runs CPU tensors)")
if available_devices() == ["cpu"]:
    # Kernel modules are imported on first use, after collection: they see the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

PLANS = {p.module: p for p in builtin_plans()}
#: A block-path connector with a table over L, and a format-2 connector of several planes.
MODULES = ["vllm_flash_attn_nhd__kv_2ltd", "vllm_int8_per_token_head__kv_planes_layer"]


def _connector(module: str):  # noqa: ANN202
    plan = PLANS[module]
    return plan, generated.get(plan.paged.name, plan.obj.name)(device="cpu", backend="triton")


def test_a_rehearsal_writes_nothing_and_counts_no_launch() -> None:
    plan, connector = _connector(MODULES[0])
    scenario = verify_connectors.scenarios("triton", "cpu")[0]
    cache = make_cache(plan.paged, torch.float32, "cpu", ext=scenario.ext)
    connector.bind(cache)
    lengths = [e - s for s, e in zip(scenario.starts, scenario.ends, strict=True)]
    objs = make_objects(connector, lengths, torch.float32, "cpu", salt=7)
    mapping = torch.arange(sum(lengths))
    cache_before, objs_before = clone_tree(cache), clone_tree([obj_tensors(o) for o in objs])
    launches = kernels.stats["launches"]
    with kernels.rehearsed() as paths:
        connector_store(connector, objs, scenario, cache, mapping)
        for o in objs:
            o.metadata.fmt = connector.format
        connector_load(connector, objs, scenario, cache, mapping)
    assert len(paths) >= 2, "a store and a load launch on paths of their own (STORE differs)"
    assert same_bits(cache, cache_before) and same_bits([obj_tensors(o) for o in objs], objs_before)
    assert kernels.stats["launches"] == launches
    with pytest.raises(RuntimeError, match="does not nest"), kernels.rehearsed(), kernels.rehearsed():
        pass


@pytest.mark.parametrize("module", MODULES)
def test_every_scenario_left_out_launches_only_paths_a_chosen_one_launched(module: str) -> None:
    plan, connector = _connector(module)
    candidates = verify_connectors.scenarios("triton", "cpu")
    chosen = verify_connectors.distinct_launches(connector, plan, candidates)
    names = [s.name for s in chosen]
    assert names[0] == candidates[0].name and 1 < len(chosen) < len(candidates)
    assert "odd_offset_objects" in names  # objects off a 16-byte boundary: a path of their own
    covered = set().union(*(verify_connectors.launch_paths(connector, plan, s) for s in chosen))
    for scenario in candidates:
        if scenario.name not in names:
            assert verify_connectors.launch_paths(connector, plan, scenario) <= covered, scenario.name


def test_a_fault_on_one_path_still_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that moves objects off a 16-byte boundary wrongly (one element of the object,
    or of the cache on a load, is spoiled after every such launch) fails the interpreter pass."""
    launch = kernels._launch

    def faulty(fn, grid, args, device) -> None:  # noqa: ANN001
        launch(fn, grid, args, device)
        if kernels._rehearsal is None and args["obj"].data_ptr() % 16:
            target = args["cache"] if not args["STORE"] else args["obj"]
            target.view(-1)[0] += 1
    plan, _ = _connector(MODULES[0])
    assert verify_connectors.check(generated, plan, "cpu", "triton")[:2] == (True, True)
    monkeypatch.setattr(kernels, "_launch", faulty)
    store_ok, load_ok, launched, runs = verify_connectors.check(generated, plan, "cpu", "triton")
    assert launched and runs < len(SCENARIOS)
    assert not (store_ok and load_ok)


def test_a_quickened_interpreter_patches_the_language_once_per_launch_and_restores_it() -> None:
    """kvgen.tools.verify.interpreter.quicken (the tests and verify run it): no 32-bit overflow
    checks, one patch of triton.language per launch however many jitted helpers a program
    calls, and the language as it was once each launch ends; a second quicken changes nothing."""
    import triton.language as tl
    from triton.runtime import interpreter as triton_interpreter

    from kvgen.tools.verify import interpreter

    assert interpreter.quicken() and interpreter.quicken()
    patch = triton_interpreter._patch_lang
    assert isinstance(patch, interpreter._PatchOnce) and not isinstance(patch.patch, interpreter._PatchOnce)
    assert not triton_interpreter.interpreter_builder.options.sanitize_overflow
    calls: list[str] = []
    original = patch.patch
    before = tl.program_id, tl.load, tl.tensor.__add__
    try:
        patch.patch = lambda fn: calls.append(fn.__name__) or original(fn)
        plan, connector = _connector(MODULES[0])
        launches = kernels.stats["launches"]
        move_pair(connector, plan.paged, plan.obj, SCENARIOS["partial_blocks"])
    finally:
        patch.patch = original
    assert kernels.stats["launches"] > launches and calls == ["_copy"] * (kernels.stats["launches"] - launches)
    assert patch.active is None and (tl.program_id, tl.load, tl.tensor.__add__) == before


HELPER = '''
import triton
from triton.language import core


@triton.jit
def put(out, v):
    core.store(out + core.arange(0, 4), v)
'''
KERNEL = '''
import triton
import triton.language as tl
from interp_helper import put


@triton.jit
def fill(out):
    put(out, tl.arange(0, 4) + 7)
'''


def test_a_helper_that_sees_another_language_module_is_still_patched(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose helper reaches triton.language.core (a module the launch's patch of
    triton.language leaves as it is) runs under the quickened interpreter as under triton's own."""
    from kvgen.tools.verify import interpreter

    assert interpreter.quicken()
    (tmp_path / "interp_helper.py").write_text(HELPER)
    (tmp_path / "interp_kernel.py").write_text(KERNEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import interp_kernel

        out = torch.zeros(4, dtype=torch.int32)
        interp_kernel.fill[(1,)](out)
    finally:  # imported from tmp_path: gone after this test
        for name in ("interp_helper", "interp_kernel"):
            sys.modules.pop(name, None)
    assert out.tolist() == [7, 8, 9, 10]


def test_a_quickened_interpreter_answers_each_dtype_as_triton_does() -> None:
    """quicken keeps each answer of the interpreter's numpy-dtype lookup (which built its whole
    table on every call): every scalar, block and pointer dtype gets triton's own answer, the
    hashable ones from the kept table from the second ask on; quicken twice wraps it once."""
    import triton.language as tl
    from triton.runtime import interpreter as triton_interpreter

    from kvgen.tools.verify import interpreter

    assert interpreter.quicken() and interpreter.quicken()
    kept = triton_interpreter._get_np_dtype
    assert isinstance(kept, interpreter._NumpyDtypes) and not isinstance(kept.lookup, interpreter._NumpyDtypes)
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64,
               tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv]
    dtypes = [*scalars, *(tl.block_type(t, [4]) for t in scalars), tl.pointer_type(tl.float32),
              tl.block_type(tl.pointer_type(tl.uint8), [8])]
    for _ in range(2):
        assert [kept(t) for t in dtypes] == [kept.lookup(t) for t in dtypes]
    assert set(scalars) <= set(kept.known)
    assert kept.known[tl.bfloat16] == np.dtype(np.uint16) and kept.known[tl.float8e4nv] == np.dtype(np.uint8)
