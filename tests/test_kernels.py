"""The generated Triton kernels: their plans, every kind of kernel against the reference
(on the CPU through Triton's interpreter, on a GPU compiled), the backend choice, and the
code Triton makes of them for an NVIDIA GPU (compiled here, without one).

`kvgen verify --backend triton` runs every kernel (in Triton's interpreter, through each
scenario whose launches take a kernel path no earlier one took: tests/test_verify_interpreter.py);
this file keeps a subset that covers each way a kernel reaches the cache (a table over one or
two list levels, one stacked tensor with L inside a block, a folded slot axis) and each
program kind.
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from harness import (
    EXT,
    SCENARIOS,
    builtin_library,
    builtin_plans,
    connector_load,
    connector_store,
    make_cache,
    make_objects,
    reference_load,
)

from kvgen import generated
from kvgen.oracle.scenarios import Scenario, check_connector, clone_tree, same_bits
from kvgen.plan.copy import CopyPlan, plan_library
from kvgen.plan.kernel import make_kernel_plan, make_planes_kernel_plan
from kvgen.plan.package import plan_package
from kvgen.plan.planes import PlanesPlan
from kvgen.runtime import KVLayoutError, kernels, native
from kvgen.tools.verify import connectors as verify_connectors

LIBRARY = builtin_library()
PLANS = {p.module: p for p in plan_library(LIBRARY)}
PARTS = {p.module: p for p in builtin_plans() if isinstance(p, PlanesPlan)}
HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install 'kvgen[triton]')")

#: One connector per way of reaching the cache, whole and layerwise.
SUBSET = [
    "vllm_flash_attn_nhd__kv_2ltd",  # table over L, rows [H C], block path by id
    "vllm_flash_attn_hnd__kv_t2d",  # table over L, layerwise, rows [KV H C] across the cache's H N
    "sglang_mha__kv_2td",  # table over KV x L, folded slot axis, layerwise
    "vllm_cross_layer__kv_2ltd",  # one stacked tensor, L and KV inside each block
    "trtllm_pool__kv_t2d",  # stacked, layerwise, rows [KV H C] over a [KV H N C] block
    "vllm_blocks_first_hnd__kv_2ltd",  # stacked, K/V packed in content: rows [C], outer KV x L x H
    "vllm_mla__kv_mla_layer",  # MLA: no KV, no heads
]
#: Slot patterns for every program kind: whole blocks by id and by a run of ids, tokens
#: by slot around -1s, several chunks, strided and odd-offset caches and objects.
SCENARIO_SUBSET = ["partial_blocks", "consecutive_blocks", "minus1_chunk_ends", "random_slots", "strided_cache",
                   "odd_offset_cache", "odd_offset_objects"]


def interpreted(scenarios: list[str], device: str) -> list[Scenario]:
    """The named scenarios as `verify --backend triton` runs them on `device`: in Triton's
    interpreter (CPU) on INTERPRETER_LAYERS layers, which still gives every layer its own table
    entry and, layerwise, its own launch."""
    by_name = {s.name: s for s in verify_connectors.scenarios("triton", device)}
    return [by_name[s] for s in scenarios]


def _kernel_device(device: str) -> None:
    why = kernels.unavailable(torch.device(device))
    if why:
        pytest.skip(why)


# -- plans (no torch, no triton) ---------------------------------------------------------------

def test_every_connector_has_a_kernel_module() -> None:
    """Caches of one tensor tree and caches of several planes (one kernel per plane) alike."""
    package = plan_package(LIBRARY)
    assert any(not isinstance(c.copy, CopyPlan) for c in package.connectors)
    assert [k.module for k in package.kernels] == [f"{c.module}_triton" for c in package.connectors]
    here = Path(generated.__file__).parent
    assert all((here / f"{k.module}.py").is_file() for k in package.kernels)


@pytest.mark.parametrize("module", list(PLANS))
def test_rows_and_outer_parts_cover_every_value_once(module: str) -> None:
    """Each value axis is either in a token's row, enumerated by grid axis 1, or (per-layer
    objects) the launch's fixed layer; the row is what both sides keep last, in one order."""
    k = make_kernel_plan(PLANS[module])
    values = {a for a in (*k.lists, *k.leaf.axes) if a not in ("B", "N", "S")}
    fixed = ["L"] if k.layerwise else []
    assert sorted([*k.row, *k.outer, *fixed]) == sorted(values)
    obj = [a for a in k.obj.axes if a != "T"]
    assert tuple(obj[len(obj) - len(k.row):]) == k.row and "C" in k.row
    assert k.row == tuple(a for a in k.leaf.axes if a in k.row)


def test_kernel_plans_of_known_layouts() -> None:
    nhd = make_kernel_plan(PLANS["vllm_flash_attn_nhd__kv_2ltd"])
    assert (nhd.lists, nhd.row, nhd.outer, nhd.slot) == (("L",), ("H", "C"), ("KV", "L"), ("B", "N"))
    packed = make_kernel_plan(PLANS["vllm_blocks_first_hnd__kv_2ltd"])
    assert (packed.lists, packed.row, packed.outer) == ((), ("C",), ("KV", "L", "H"))
    sglang = make_kernel_plan(PLANS["sglang_mha__kv_2td"])
    assert (sglang.lists, sglang.slot, sglang.outer) == (("KV", "L"), ("S",), ("KV",))
    assert "tl.load(table + kv * E_L + layer)" in "\n".join(sglang.body)


def test_launch_facts_are_the_plans() -> None:
    """What a launch needs besides extents, strides and addresses is written into the twin's
    KernelSpec at build time: whole-block programs over B x N caches, none over a folded slot
    axis; at most 64 tokens a tile, one for a plane without slots, whose row starts the
    alignment hint divides on both sides; the word of the views."""
    nhd = make_kernel_plan(PLANS["vllm_flash_attn_nhd__kv_2ltd"])
    assert dict(nhd.spec_fields) == {
        "table": True, "layerwise": False, "extents": ("L",), "row": ("H", "C"), "outer": ("KV", "L"),
        "cache_axes": ("KV", "B", "N", "H", "C"), "object_axes": ("KV", "L", "T", "H", "C"), "blocks": True,
        "tile": 64, "slotless": False, "widen": True}
    sglang = dict(make_kernel_plan(PLANS["sglang_mha__kv_2td"]).spec_fields)
    assert (sglang["blocks"], sglang["tile"], sglang["table"]) == (False, 64, True)
    scales = make_planes_kernel_plan(PARTS["vllm_fp8_tensor_scales__kv_planes"])
    kv, k_scale = dict(scales.planes[0].spec_fields), dict(scales.planes[1].spec_fields)
    assert (kv["blocks"], kv["tile"], kv["aligned"]) == (True, 64, True)
    assert kv["cache_starts"] == ("B", "N") and "KV" not in kv["cache_starts"]
    assert (k_scale["blocks"], k_scale["tile"], k_scale["slotless"]) == (False, 1, True)


@needs_triton
def test_a_launch_takes_its_tile_from_the_kernel_spec(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch reads the plan's facts, not the layout: the same kernel with a KernelSpec of
    one token a tile launches one program per token of the token path, and still moves what
    the reference moves."""
    _kernel_device(device)
    plan = PLANS["vllm_flash_attn_nhd__kv_2ltd"]
    base = kernels.kernel_of(generated.get(plan.paged.name, plan.obj.name).__module__)
    one = kernels.Kernel(base.fn, replace(base.spec, tile=1))
    launched: list[tuple[tuple[int, int], dict[str, object]]] = []
    real = kernels._launch

    def spy(fn: object, grid: tuple[int, int], args: dict[str, object], dev: torch.device) -> None:
        launched.append((grid, args))
        real(fn, grid, args, dev)  # type: ignore[arg-type]

    monkeypatch.setattr(kernels, "_launch", spy)
    sc = SCENARIOS["partial_blocks"]
    cache = make_cache(plan.paged, torch.float32, device)
    mapping = torch.tensor(sc.mapping(random.Random(0), EXT), device=device)
    results, runs = [], []
    for kernel in (base, one):
        c = generated.get(plan.paged.name, plan.obj.name)(device=device)
        c._pin(torch.device(device), "triton", (c, kernel))
        c.bind(cache)
        objs = make_objects(c, [13], torch.float32, device, salt=3, fmt=c.format)
        launched.clear()
        connector_store(c, objs, sc, cache, mapping)
        results.append([o.tensor.clone() for o in objs])
        runs.append(list(launched))
    assert runs[0] and all(args["TILE"] > 1 for _, args in runs[0])
    assert runs[1] and all(args["TILE"] == 1 and grid[0] == args["num_blocks"] + args["num_tokens"]
                           for grid, args in runs[1])
    assert sum(grid[0] for grid, _ in runs[1]) > sum(grid[0] for grid, _ in runs[0])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


# -- kernels against the reference -------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("module", SUBSET)
def test_kernel_matches_reference(module: str, device: str) -> None:
    _kernel_device(device)
    plan = PLANS[module]
    before = kernels.stats["launches"]
    results = check_connector(generated, plan.paged, plan.obj, device, interpreted(SCENARIO_SUBSET, device),
                              backend="triton")
    wrong = [(s, r) for s, r in zip(SCENARIO_SUBSET, results, strict=True) if r != (True, True)]
    assert not wrong, f"(store ok, load ok) differ from the reference: {wrong}"
    assert kernels.stats["launches"] > before, "the kernel never ran"


@needs_triton
@pytest.mark.parametrize("module", ["vllm_flash_attn_hnd__kv_t2d", "sglang_mla__kv_mla"])
def test_rows_split_across_programs(module: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With few tokens, rows are split into pieces on grid axis 1; pieces of one word test
    the decoding of every row position."""
    _kernel_device(device)
    monkeypatch.setattr(kernels, "MIN_PIECE", 1)
    monkeypatch.setattr(kernels, "MIN_PROGRAMS", 1 << 30)
    plan = PLANS[module]
    results = check_connector(generated, plan.paged, plan.obj, device, [SCENARIOS["minus1_chunk_ends"]],
                              backend="triton")
    assert results == [(True, True)]


@needs_triton
def test_kernel_skips_prefix_with_offset(device: str) -> None:
    _kernel_device(device)
    plan = PLANS["vllm_flash_attn_nhd__kv_t2d"]
    mapping_list = [5, 6, 7, -1, 16, 17, 18, 19, 40, 41, 42, 43, 3]
    sc = SCENARIOS["partial_blocks"].__class__("skip", (4,), (17,), lambda r, e: mapping_list, offset=4)
    connector = generated.get(plan.paged.name, plan.obj.name)(device=device, backend="triton")
    cache = make_cache(plan.paged, torch.float32, device)
    connector.bind(cache)
    objs = make_objects(connector, [13], torch.float32, device, salt=5, fmt=connector.format)
    expected = clone_tree(cache)
    mapping = torch.tensor(mapping_list, device=device)
    connector_load(connector, objs, replace(sc, skip=6), cache, mapping)
    reference_load(plan.paged, plan.obj, expected, objs, replace(sc, skip=6), mapping_list)
    assert same_bits(cache, expected)


# -- the backend choice ------------------------------------------------------------------------

def _nhd(**options: object) -> object:
    return generated.get("vllm_flash_attn_nhd", "kv_2ltd")(device="cpu", **options)


def test_auto_never_picks_the_interpreter_and_torch_never_launches() -> None:
    before = kernels.stats["launches"]
    # On the CPU, auto takes the compiled CPU kernel where it builds, else torch ops; never Triton.
    assert _nhd().copy_backend_for("cpu") == ("native" if native.unavailable() is None else "torch")
    plan = PLANS["vllm_flash_attn_nhd__kv_2ltd"]
    assert check_connector(generated, plan.paged, plan.obj, "cpu", [SCENARIOS["partial_blocks"]],
                           backend="torch") == [(True, True)]
    assert kernels.stats["launches"] == before


def test_backend_names_are_checked() -> None:
    with pytest.raises(KVLayoutError, match="backend must be one of 'triton', 'native', 'torch' or None"):
        _nhd(backend="cuda")


def test_forced_triton_refuses_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "triton_installed", lambda: False)
    with pytest.raises(KVLayoutError, match=r"backend='triton' cannot run here: triton is not installed"):
        _nhd(backend="triton")
    monkeypatch.undo()
    if HAVE_TRITON:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(KVLayoutError, match="only in its interpreter"):
            _nhd(backend="triton")


@needs_triton
def test_a_connector_without_kernel_module(device: str) -> None:
    """A connector class whose module has no `_triton` twin (a package built before kernels)."""
    _kernel_device(device)
    base = generated.get("vllm_flash_attn_nhd", "kv_2ltd")
    mine = type("Mine", (base,), {"program": base.program, "__module__": "my_package.my_connector"})
    assert base(device=device, backend="triton").copy_backend_for(device) == "triton"
    with pytest.raises(KVLayoutError, match="no kernel module was generated for this connector"):
        mine(device=device, backend="triton").copy_backend_for(device)


@needs_triton
def test_caches_the_kernel_cannot_address(device: str) -> None:
    """Leaves with different strides: forced triton refuses before anything is written;
    auto (here, a connector told to use the kernel) falls back to the torch ops."""
    _kernel_device(device)
    plan = PLANS["vllm_flash_attn_nhd__kv_2ltd"]
    cache = make_cache(plan.paged, torch.float32, device)
    odd = cache[1].transpose(1, 2).contiguous().transpose(1, 2)  # same shape, other strides
    odd.copy_(cache[1])
    cache[1] = odd
    sc = SCENARIOS["partial_blocks"]
    mapping = torch.tensor(sc.mapping(random.Random(0), EXT), device=device)
    forced = generated.get(plan.paged.name, plan.obj.name)(device=device, backend="triton")
    forced.bind(cache)
    objs = make_objects(forced, [13], torch.float32, device, salt=3, fmt=forced.format)
    untouched = clone_tree(cache)
    with pytest.raises(KVLayoutError, match="cache tensors differ in strides"):
        connector_load(forced, objs, sc, cache, mapping)
    assert same_bits(cache, untouched)

    auto = generated.get(plan.paged.name, plan.obj.name)(device=device)
    auto._pin(torch.device(device), "triton", (auto, kernels.kernel_of(type(auto).__module__)))
    before = kernels.stats["launches"]
    connector_store(auto, objs, sc, cache, mapping)
    connector_load(auto, objs, sc, cache, mapping)
    assert kernels.stats["launches"] == before
    reference = generated.get(plan.paged.name, plan.obj.name)(device=device, backend="torch")
    reference.bind(untouched)
    twin = make_objects(reference, [13], torch.float32, device, salt=3, fmt=reference.format)
    connector_store(reference, twin, sc, untouched, mapping)
    assert same_bits([o.tensor for o in objs], [o.tensor for o in twin])


# -- the code Triton makes for a GPU -------------------------------------------------------------

@needs_triton
def test_kernels_compile_for_h200_with_16_byte_rows() -> None:
    """Compiled for sm_90 with the bundled ptxas, with the specializations a real launch gets
    (one process compiles both connectors' kernels):

    - a format-1 connector (vllm_flash_attn_hnd/kv_2ltd): every store and the data loads are
      16-byte vectors;
    - fp8 MLA planes (vllm_mla_fp8/kv_mla_rows_layer): the 512- and 128-byte planes of a
      656-byte row (82 words, a stride the compiler cannot see is even) move as 16-byte vectors
      through the row alignment VA; the 16-byte scale plane in whole 8-byte words."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "kvgen.tools.kernel_asm", "--only", "vllm_flash_attn_hnd__kv_2ltd",
                           "--only", "vllm_mla_fp8__kv_mla_rows_layer"],
                          capture_output=True, text=True, env=env, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)
    if done.returncode != 0 and "ptxas" in done.stderr:
        pytest.skip(f"Triton cannot compile for NVIDIA here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    assert [(r[2], r[3], r[4]) for r in rows if r[0] == "vllm_flash_attn_hnd__kv_2ltd"] == \
        [("store", "16-byte", "rows"), ("load", "16-byte", "rows")]
    verdicts = {(r[1], r[2]): r[3] for r in rows if r[0] == "vllm_mla_fp8__kv_mla_rows_layer"}
    assert verdicts == {(p, d): "16-byte" if p != "scale" else "8-byte"
                        for p in ("nope", "scale", "rope") for d in ("store", "load")}
    assert len(rows) == 2 + len(verdicts)


# -- the command line --------------------------------------------------------------------------

def test_verify_backend_triton_refuses_what_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgen.errors import KVGenError
    from kvgen.tools.verify import run as verify

    if HAVE_TRITON:
        with pytest.raises(KVGenError, match="verify --device cpu and the GPU devices separately"):
            verify._prepare_triton(["cpu", "cuda"])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(KVGenError, match=r"--backend triton needs triton: pip install 'kvgen\[triton\]'"):
        verify._prepare_triton(["cpu"])


def test_list_and_explain_show_kernels_and_backends(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvgen.tools.cli import main

    assert main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    cpu = "native" if native.unavailable() is None else "torch"
    assert data["backends"]["cpu"] == cpu
    assert data["backends"]["cuda"].startswith("triton" if HAVE_TRITON else "torch")
    nhd = next(c for c in data["connectors"] if c["module"] == "vllm_flash_attn_nhd__kv_2ltd")
    assert nhd["kernel"] == ("one launch per chunk, grid (whole blocks + token tiles, KV x L); rows [H C]; "
                             "leaves by a table over L")
    fp8 = next(c for c in data["connectors"] if c["module"] == "vllm_mla_fp8__kv_mla_rows")
    assert fp8["kernel"].startswith("one launch per plane per chunk (3 planes)")
    assert all(c["kernel"] for c in data["connectors"])
    assert main(["explain", "NHD"]) == 0
    out = capsys.readouterr().out
    assert "triton kernel: one launch per layer and chunk" in out and f"copy backend (backend=None): cpu {cpu}" in out
    assert all(c["cpu_kernel"].startswith("compiled") for c in data["connectors"])
    assert main(["explain", "vllm_mla_fp8"]) == 0  # several planes: one program per plane
    out = capsys.readouterr().out
    assert f"copy backend (backend=None): cpu {cpu}," in out and "cpu kernel:    compiled\n" in out
    assert main(["explain", "sglang_mha_mxfp8_interleaved"]) == 0  # split block slots
    out = capsys.readouterr().out
    assert "cpu kernel:    compiled (block slots split as N/32 x N%32)" in out
    assert "k_scale: rows [H C E], block slots split as N/32 x N%32, outer L;" in out  # its Triton kernels
    assert "no Triton kernel" not in out


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install 'kvgen[triton]')")
def test_verify_backend_triton_runs_every_connector(capsys: pytest.CaptureFixture[str]) -> None:
    """Caches of several planes included; transfers alone have no kernel to run."""
    from kvgen.tools.cli import main

    assert main(["verify", "--backend", "triton", "--device", "cpu", "--only", "xfer__vllm_mla__sglang_mla"]) == 1
    assert "the selected modules are transfers or model connectors" in capsys.readouterr().err
    assert main(["verify", "--backend", "triton", "--device", "cpu", "--only", "sglang_mha_v_head__kv_planes_layer"]) \
        == 0
    out = capsys.readouterr().out
    assert "sglang_mha_v_head" in out and "no Triton kernel" not in out and "2 checks passed, 0 failed" in out
