"""Transfers with a cache of head groups (SGLang's page_unified host pool: H split as `H/g` with
`H%g`, the group size read from the tensor): the other side's heads are viewed as the same groups,
a TP head range moves whole groups and one that cuts a group is refused before anything moves,
two caches of groups must group alike; the compiled kernel and the torch copies both move them.
Every result is compared with the element-by-element reference (kvgen.oracle.reference.transfers);
tests/test_transfers.py runs the scenario tables and tests/test_engine_sglang.py SGLang's own pools."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgen import generated, tp
from kvgen.errors import KVLayoutError
from kvgen.oracle.reference import transfers
from kvgen.oracle.scenarios import clone_tree, same_bits
from kvgen.oracle.scenarios.transfers import DST_EXT, SRC_EXT, make_cache, run_transfer
from kvgen.runtime import native
from kvgen.spec.elements import split_extents
from kvgen.spec.library import load_library
from kvgen.tools.cli import main

LIBRARY = load_library()
GROUPED, MHA = LIBRARY["hicache_page_unified_grouped"], LIBRARY["sglang_mha"]
SLOTS = [5, 6, 7, 8, 9, 10, 11, 29, 30, -1, 2]
TARGET = [0, 1, 2, 3, 4, 37, 38, 39, -1, 12, 13]


def grouped_ext(base: dict[str, int], heads: int, group: int) -> dict[str, int]:
    ext = {**base, "H": heads, "H%g": group}
    return {**ext, **split_extents(GROUPED.axes, ext)}


def moved(src: Any, dst: Any, ranges: tp.HeadRanges | None, layerwise: bool, group: int = 2,
          backend: str | None = None) -> tuple[bool, bool]:
    """(the destination is the reference's, something moved) for sglang_mha -> the grouped pool
    or back (`src`, `dst` the two specs), heads H = 6 in groups of `group`, on `backend`."""
    src_ext = grouped_ext(SRC_EXT, 6, group) if src is GROUPED else {**SRC_EXT, "H": 6}
    dst_ext = grouped_ext(DST_EXT, 6, group) if dst is GROUPED else {**DST_EXT, "H": 6}
    a = make_cache(src, src_ext, torch.float32, "cpu")
    b = make_cache(dst, dst_ext, torch.float32, "cpu", 10000)
    before, want = clone_tree(b), clone_tree(b)
    run_transfer(generated.transfer(src.name, dst.name)(copy_backend=backend), (a, torch.tensor(SLOTS)),
                 (b, torch.tensor(TARGET)), layerwise=layerwise, heads=ranges)
    sh, dh = (ranges.src_heads, ranges.dst_heads) if ranges is not None else (None, None)
    transfers.transfer(transfers.TransferSide(src, src_ext, a, SLOTS, sh),
                       transfers.TransferSide(dst, dst_ext, want, TARGET, dh))
    return same_bits(b, want), not same_bits(b, before)


needs_kernel = pytest.mark.skipif(bool(native.unavailable()), reason=f"no compiled kernel: {native.unavailable()}")
BACKENDS = [pytest.param("native", marks=needs_kernel), "torch"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layers"])
@pytest.mark.parametrize("group", [1, 2, 3, 6])
def test_every_group_size_moves_both_ways(group: int, layerwise: bool, backend: str) -> None:
    for src, dst in ((MHA, GROUPED), (GROUPED, MHA)):
        assert moved(src, dst, None, layerwise, group, backend) == (True, True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ranges", [tp.HeadRanges((2, 6), (0, 4)), tp.HeadRanges((0, 2), (4, 6))],
                         ids=["upper", "lower"])
def test_head_ranges_of_whole_groups_move_right(ranges: tp.HeadRanges, backend: str) -> None:
    assert moved(MHA, GROUPED, ranges, False, backend=backend) == (True, True)
    back = tp.HeadRanges(ranges.dst_heads, ranges.src_heads)
    assert moved(GROUPED, MHA, back, True, backend=backend) == (True, True)


@needs_kernel
def test_a_plain_range_inside_a_group_moves_on_torch_and_the_kernel_refuses_it() -> None:
    """sglang_mha's range may start anywhere (its heads are viewed as the other side's groups
    from there); the compiled kernel steps whole groups on both sides, so by default such a call
    falls back to the torch copies, and a forced compiled one is refused before a byte moves."""
    ranges = tp.HeadRanges((1, 5), (2, 6))
    fallbacks = native.stats["fallbacks"]
    assert moved(MHA, GROUPED, ranges, False) == (True, True)
    assert native.stats["fallbacks"] == fallbacks + 1
    with pytest.raises(KVLayoutError, match="a head range that starts inside a group of 2 heads"):
        moved(MHA, GROUPED, ranges, False, backend="native")


@needs_kernel
def test_the_compiled_transfer_moves_head_groups() -> None:
    """The plan walks the other side's H as the group's tile and place (its tile's stride the
    group's size of H's), so the kernel moves the pair; every call counted on it."""
    program = generated.transfer("sglang_mha", "hicache_page_unified_grouped").program
    assert program.compiled is None and ("H/g", 1, ("H%g",)) in program.src_places
    calls = native.stats["calls"]
    assert moved(MHA, GROUPED, None, False, 2, "native") == (True, True)
    assert native.stats["calls"] > calls


@pytest.mark.parametrize("src, dst, ranges, side", [
    (MHA, GROUPED, tp.HeadRanges((0, 3), (1, 4)), "dst"),
    (GROUPED, MHA, tp.HeadRanges((3, 5), (0, 2)), "src"),
])
def test_a_range_that_cuts_a_group_is_refused_before_anything_moves(src: Any, dst: Any, ranges: tp.HeadRanges,
                                                                     side: str) -> None:
    src_ext = grouped_ext(SRC_EXT, 6, 2) if src is GROUPED else {**SRC_EXT, "H": 6}
    dst_ext = grouped_ext(DST_EXT, 6, 2) if dst is GROUPED else {**DST_EXT, "H": 6}
    a, b = make_cache(src, src_ext, torch.float32, "cpu"), make_cache(dst, dst_ext, torch.float32, "cpu", 10000)
    before = clone_tree(b)
    with pytest.raises(KVLayoutError, match=rf"{side}_heads \(\d, \d\) cuts a group of 2 heads of {side}_caches"):
        generated.transfer(src.name, dst.name)().copy(a, torch.tensor(SLOTS), b, torch.tensor(TARGET), heads=ranges)
    assert same_bits(b, before)


def test_two_caches_of_groups_must_group_alike(tmp_path: Path) -> None:
    """A transfer between two pools of head groups (a user's transfers.yaml line) moves between
    pools of one group size and refuses two sizes, nothing written."""
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "transfers.yaml").write_text("kvgen: 1\ntransfers:\n"
                                          "  - hicache_page_unified_grouped -> hicache_page_unified_grouped\n")
    assert main(["build", "--specs", str(specs), "--out", str(tmp_path / "grouped_pairs")]) == 0
    sys.path.insert(0, str(tmp_path))
    try:
        package = __import__("grouped_pairs")
        cls = package.transfer("hicache_page_unified_grouped", "hicache_page_unified_grouped")
        a = make_cache(GROUPED, grouped_ext(SRC_EXT, 4, 2), torch.float32, "cpu")
        same = make_cache(GROUPED, grouped_ext(DST_EXT, 4, 2), torch.float32, "cpu", 10000)
        want = clone_tree(same)
        cls().copy(a, torch.tensor(SLOTS), same, torch.tensor(TARGET))
        transfers.transfer(transfers.TransferSide(GROUPED, grouped_ext(SRC_EXT, 4, 2), a, SLOTS),
                           transfers.TransferSide(GROUPED, grouped_ext(DST_EXT, 4, 2), want, TARGET))
        assert same_bits(same, want)
        other = make_cache(GROUPED, grouped_ext(DST_EXT, 4, 4), torch.float32, "cpu", 10000)
        before = clone_tree(other)
        with pytest.raises(KVLayoutError, match="heads in groups of 2 and dst_caches in groups of 4"):
            cls().copy(a, torch.tensor(SLOTS), other, torch.tensor(TARGET))
        assert same_bits(other, before)
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("grouped_pairs")]:
            del sys.modules[name]


def test_a_literal_split_of_h_is_no_head_group_for_a_transfer(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    """Only a factor read from the tensor makes heads a group a transfer views the other side as:
    a literal split of H is a tiling transfers do not plan, refused when the build reads the line."""
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "pairs.yaml").write_text("kvgen: 3\nname: t_literal_groups\nkind: paged\nsummary: Heads in pairs.\n"
                                      "dims: [B, H/2, L, KV, N, H%2, C]\nsizes: {KV: 2}\n")
    (specs / "transfers.yaml").write_text("kvgen: 1\ntransfers:\n  - sglang_mha -> t_literal_groups\n")
    assert main(["build", "--specs", str(specs), "--out", str(tmp_path / "out")]) != 0
    assert ("t_literal_groups is a spec format 3 layout with parts, fields or split axes; transfers move single-part "
            "(format 1) layouts only, and one tree whose only split axes split H by a factor read from the tensor "
            "(H/g, H%g)") in capsys.readouterr().err
