"""The copy description the planner writes into every connector (kvgen.plan.program): what
it decides from the two layouts alone, and that the generated modules carry exactly it."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest
from harness import builtin_library, builtin_plans

from kvgen import generated
from kvgen.plan import splits
from kvgen.plan.copy import CopyPlan
from kvgen.plan.program import KERNEL_DIMS, ProgramPlan, program_plan, transfer_program
from kvgen.runtime import CopyPath, CopyProgram, TransferPath, native

LIBRARY = builtin_library()
PLANS = {p.module: p for p in builtin_plans()}

def _program_of(plan: ProgramPlan) -> CopyProgram:
    return CopyProgram(**dict(plan.fields), paths=tuple(CopyPath(**dict(p)) for p in plan.paths))


def _rendered(module: str) -> CopyProgram:
    paged, obj = module.split("__")
    return generated.get(paged, obj).program

def test_the_kernel_dims_bound_is_the_kernels() -> None:
    source = resources.files("kvgen.runtime").joinpath("csrc/kvcopy.c").read_text()
    found = re.search(r"#define KV_MAXD (\d+)", source)
    assert found is not None and int(found.group(1)) == KERNEL_DIMS == native.MAX_DIMS

@pytest.mark.parametrize("module", sorted(PLANS))
def test_every_generated_module_carries_its_planned_program(module: str) -> None:
    """The module's PROGRAM is the plan's, field by field (kvgen check finds a stale build; this
    finds a template that drops or renames a field)."""
    plan = program_plan(PLANS[module])
    got = _rendered(module)
    for name, value in plan.fields:
        assert getattr(got, name) == value, name
    assert got.paths == tuple(CopyPath(**dict(p)) for p in plan.paths)
    if isinstance(PLANS[module], CopyPlan):
        assert got.compiled is None, got.compiled
        assert [p.name for p in got.paths] == (["tokens"] if got.folded else ["blocks", "tokens"])
    else:  # one program per plane, each planned like a one-tree copy over the plane's byte views
        # (split axes among them: tests/test_split_connectors.py)
        assert got.compiled is None and got.paths == ()
        assert len(got.planes) == len(PLANS[module].planes) and all(p.compiled is None for p in got.planes)
        assert got.planes == tuple(_program_of(p) for p in plan.planes)
        for pc, program in zip(PLANS[module].planes, got.planes, strict=True):
            assert program.slotless == pc.slotless
            assert [p.name for p in program.paths] == (["plane"] if pc.slotless else
                                                      ["tokens"] if program.folded else ["blocks", "tokens"])
            assert program.slot_split == splits.splits(pc.plane.part, "N")  # (N/f, N%f), or ()

def test_an_nhd_block_is_one_run_and_a_split_content_is_not() -> None:
    """NHD cache [KV B N H C] to [KV L T (H C)]: a block's slots, heads and content are adjacent
    on both sides, so one run. LBNHC [B N H (KV C)]: K and V split each slot's content, so only
    C is a run. The token path never merges its indexed dim."""
    nhd = _rendered("vllm_flash_attn_nhd__kv_2ltd")
    blocks, tokens = nhd.path("blocks"), nhd.path("tokens")
    assert blocks is not None and tokens is not None
    assert blocks.store == ("L", "KV", "B", "N", "H", "C") and blocks.store_run == ("N", "H", "C")
    assert blocks.load == ("KV", "L", "B", "N", "H", "C") and blocks.load_run == ("N", "H", "C")
    assert tokens.store == ("L", "KV", "T", "H", "C") and tokens.store_run == ("H", "C")
    lbnhc = _rendered("vllm_lbnhc__kv_2ltd")
    assert lbnhc.cache_places[-2:] == (("KV", 3, ("C",)), ("C", 3, ()))
    assert all(p.store_run == ("C",) and p.load_run == ("C",) for p in lbnhc.paths)

def test_each_direction_walks_the_side_it_reads_front_to_back() -> None:
    """A load reads the object in the object's axis order, a store the cache in the cache's (its
    list levels, then its leaf's axes): walking the other side's order reads a stride apart."""
    programs = [(m, q) for m in PLANS for q in (_rendered(m).planes or (_rendered(m),))]
    assert len({m for m, q in programs if q.paths and not isinstance(PLANS[m], CopyPlan)}) > 10  # several planes too
    for module, program in programs:
        objects = [place[0] for place in program.object_places]
        cache = [*program.cache_lists, *(place[0] for place in program.cache_places)]
        block = "S" if program.folded else "B"
        for path in program.paths:
            slot = {"B", "N", *program.slot_split}  # at the object's T
            ranks = [objects.index("T" if d in slot else d) for d in path.load if d != "L" or "L" in objects]
            assert ranks == sorted(ranks), (module, path.name, path.load)
            ranks = [cache.index(block if d in ("B", "T") else d) for d in path.store]
            assert ranks == sorted(ranks), (module, path.name, path.store)
            assert sorted(path.store) == sorted(path.load), (module, path.name)


def test_a_folded_slot_axis_has_the_token_path_only() -> None:
    """SGLang's [B N] page buffer is one slot dim S: tokens by slot, no block path."""
    folded = [m for m in PLANS if isinstance(PLANS[m], CopyPlan) and _rendered(m).folded]
    assert folded
    for module in folded:
        program = _rendered(module)
        assert any(place[0] == "S" for place in program.cache_places), module
        assert [p.name for p in program.paths] == ["tokens"], module

def test_layerwise_objects_leave_the_layer_out_of_the_shared_axes() -> None:
    """A per-layer object moves one layer per call, an offset on the cache: L is no dim."""
    program = _rendered("vllm_flash_attn_nhd__kv_2td")
    assert program.layerwise and "L" not in program.shared
    assert all("L" not in p.store and "L" not in p.load for p in program.paths)


XFERS = sorted(p.stem for p in Path(generated.__file__).parent.glob("xfer__*.py"))


@pytest.mark.parametrize("module", XFERS)
def test_every_transfer_module_carries_its_planned_program(module: str) -> None:
    _, src, dst = module.split("__")
    plan = transfer_program(LIBRARY[src], LIBRARY[dst])
    got = generated.transfer(src, dst).program
    for name, value in plan.fields:
        assert getattr(got, name) == value, name
    assert got.paths == tuple(TransferPath(**dict(p)) for p in plan.paths)
    assert got.compiled is None and [p.name for p in got.paths] == ["blocks", "tokens"]
    assert all("L" in p.whole and p.layer == tuple(d for d in p.whole if d != "L") for p in got.paths)


def test_a_transfer_program_orders_dims_as_the_source_lays_them_out() -> None:
    """HND -> NHD: the source keeps H before N, so a whole block's heads come before its slots
    (each source leaf is read front to back); only C is adjacent on both sides (the destination
    has H inside N). NHD -> HiCache page-first: the source's layers are its leaves, outermost."""
    blocks = generated.transfer("vllm_flash_attn_hnd", "vllm_flash_attn_nhd").program.path("blocks")
    assert blocks is not None
    assert blocks.whole == ("L", "KV", "B", "H", "N", "C") and blocks.layer == ("KV", "B", "H", "N", "C")
    page_first = generated.transfer("vllm_flash_attn_nhd", "hicache_page_first").program.path("blocks")
    assert page_first is not None and page_first.whole[0] == "L"
    assert blocks.whole_run == blocks.layer_run == ("C",)
    same = generated.transfer("vllm_flash_attn_nhd", "vllm_flash_attn_nhd").program.path("blocks")
    assert same is not None and same.layer_run == ("N", "H", "C")  # a whole block is one run
