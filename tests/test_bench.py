"""`kvgen bench`: rotated, paired timing driven by fake clocks; the stability flag; the
table and JSON; user layouts through --specs; selections that match nothing; and the naive
baseline's agreement with the connectors. No assertions on real speed: figures depend on
the machine."""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from kvgen import generated
from kvgen.oracle.reference.layouts import fill_cache, leaf_shape, nest
from kvgen.spec.library import load_library
from kvgen.tools import bench
from kvgen.tools.bench import plot as bench_plot
from kvgen.tools.bench import report
from kvgen.tools.bench.baseline import NaiveConnector
from kvgen.tools.bench.measure import (
    CONTENDERS,
    MEMCPY_VARIATION_LIMIT,
    CheckCost,
    Row,
    Spread,
    paired_ratios,
    rotation,
    timed_repeats,
    variation,
)
from kvgen.tools.bench.run import Result, Transfers
from kvgen.tools.bench.targets import DEFAULT_LAYOUTS, DEFAULT_OBJECTS, extents, select_targets, slot_mapping
from kvgen.tools.cli import main

TINY = ["-L", "2", "--heads", "2", "--head-size", "8", "--block-size", "4", "--warmup", "0", "--repeats", "1",
        "--models", "none"]


# -- timing with a fake clock ---------------------------------------------------------


class FakeClock:
    """A clock that only moves when a contender runs: each call of a contender advances it
    by that contender's next scripted duration, and the call is logged."""

    def __init__(self, durations: dict[str, list[float]]):
        self.now = 0.0
        self.durations = {k: list(v) for k, v in durations.items()}
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def contender(self, name: str):
        def run() -> None:
            self.calls.append(name)
            self.now += self.durations[name].pop(0)

        return run


def _timed(durations: dict[str, list[float]], warmup: int, repeats: int) -> tuple[dict[str, list[float]], FakeClock]:
    clock = FakeClock(durations)
    fns = {name: clock.contender(name) for name in durations}
    return timed_repeats(fns, lambda: None, warmup, repeats, clock=clock), clock


def test_rotation_gives_every_contender_every_position() -> None:
    orders = [rotation(CONTENDERS, i) for i in range(4)]
    assert orders == [["kvgen", "memcpy", "naive"], ["memcpy", "naive", "kvgen"],
                      ["naive", "kvgen", "memcpy"], ["kvgen", "memcpy", "naive"]]


def test_repeats_run_in_rotated_order_and_keep_each_repeat_apart() -> None:
    # warmup 1 (durations 100+), then 4 timed repeats with distinct durations per repeat
    durations = {"kvgen": [100.0, 8.0, 2.0, 6.0, 4.0], "memcpy": [100.0, 7.0, 1.0, 5.0, 3.0],
                 "naive": [100.0, 30.0, 10.0, 40.0, 20.0]}
    times, clock = _timed(durations, warmup=1, repeats=4)
    assert clock.calls == [*rotation(CONTENDERS, 0),  # warmup
                           *rotation(CONTENDERS, 0), *rotation(CONTENDERS, 1), *rotation(CONTENDERS, 2),
                           *rotation(CONTENDERS, 3)]
    # each list holds exactly that contender's timed repeats, in repeat order: no warmup, no mixing
    assert times == {"kvgen": [8.0, 2.0, 6.0, 4.0], "memcpy": [7.0, 1.0, 5.0, 3.0], "naive": [30.0, 10.0, 40.0, 20.0]}


def test_ratios_are_paired_per_repeat_not_ratios_of_medians() -> None:
    # the machine slows down 10x on repeat 1 and kvgen's repeat 2 is an outlier: paired ratios
    # see memcpy/kvgen = 0.5 on repeats 0 and 1; a ratio of medians would say 15 / 4 = 3.75
    times, _ = _timed({"kvgen": [2.0, 40.0, 30.0], "memcpy": [1.0, 20.0, 15.0], "naive": [4.0, 80.0, 60.0]},
                      warmup=0, repeats=3)
    row = Row("l", "o", "whole", 8, "store", 10**9, times, True)
    assert row.x_memcpy == Spread(0.5, 0.5, 0.5)
    assert row.x_naive == Spread(2.0, 2.0, 2.0)
    assert paired_ratios([3.0, 1.0, 8.0], [1.0, 1.0, 2.0]) == Spread(1.0, 3.0, 4.0)
    assert row.gbps("kvgen") == pytest.approx(1 / 30.0)  # bytes / median seconds / 1e9
    with pytest.raises(ValueError):
        paired_ratios([1.0, 2.0], [1.0])


@pytest.mark.parametrize(("memcpy_s", "flagged"), [
    ([1.0, 1.25, 1.1], False),   # exactly 25%: at the limit, not over it
    ([1.0, 1.26, 1.1], True),
    ([2.0, 1.0, 1.0], True),     # one slow repeat among fast ones
    ([1.0], False),
])
def test_memcpy_variation_over_25_percent_is_flagged(memcpy_s: list[float], flagged: bool) -> None:
    n = len(memcpy_s)
    row = Row("vllm_flash_attn_nhd", "kv_2ltd", "whole", 16, "load", 4096,
              {"kvgen": [2.0] * n, "memcpy": memcpy_s, "naive": [4.0] * n}, True)
    assert MEMCPY_VARIATION_LIMIT == 0.25
    assert row.memcpy_variation == pytest.approx(max(memcpy_s) / min(memcpy_s) - 1)
    assert row.memcpy_unstable is flagged
    steady = Row("vllm_flash_attn_nhd", "kv_2ltd", "whole", 16, "store", 4096,
                 {"kvgen": [2.0] * n, "memcpy": [1.0] * n, "naive": [4.0] * n}, True)
    result = Result({"layers": 2, "heads": 2, "head_size": 8, "block_size": 4, "dtype": "bfloat16",
                     "alloc": "random", "repeats": n, "warmup": 0},
                    [steady, row], [CheckCost("vllm_flash_attn_nhd", "kv_2ltd", {"bind fresh": 1.0})])
    machine = {"device": "cpu", "cpu_model": "test", "cpu_count": 2, "torch": "x"}
    printed = report.text(result, machine)
    lines = printed.splitlines()
    load_line = next(line for line in lines if line.startswith("vllm_flash_attn_nhd") and " load " in line)
    store_line = next(line for line in lines if line.startswith("vllm_flash_attn_nhd") and " store " in line)
    assert (report.UNSTABLE_MARK in load_line) is flagged
    assert report.UNSTABLE_MARK not in store_line
    assert ("WARNING: the memcpy baseline varied by more than 25%" in printed) is flagged
    data = json.loads(json.dumps(report.as_json(result, machine)))
    assert [r["memcpy_unstable"] for r in data["rows"]] == [False, flagged]
    assert data["memcpy_unstable_rows"] == int(flagged)
    assert data["rows"][1]["repeat_seconds"]["memcpy"] == memcpy_s


def test_check_costs_are_named_timings_and_new_ones_get_columns() -> None:
    checks = [CheckCost("a", "kv_2ltd", {"bind fresh": 12.5, "plan_chunk T=6": 3.25}),
              CheckCost("b", "kv_t2d", {"bind fresh": 9.0, "plan_chunk T=6": 2.0, "new check": 7.0})]
    lines = report.check_table(checks).splitlines()
    assert lines[0].split() == ["layout", "object", "bind", "fresh", "us", "plan_chunk", "T=6", "us", "new", "check",
                                "us"]
    assert lines[2].split() == ["a", "kv_2ltd", "12.50", "3.25", "-"]
    assert lines[3].split() == ["b", "kv_t2d", "9.00", "2.00", "7.00"]


# -- the command ----------------------------------------------------------------------


def test_smoke_table_and_json(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.json"
    rc = main(["bench", "--layouts", "NHD", "--objects", "kv_2ltd", "--tokens", "6,16", *TINY, "--repeats", "3",
               "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0
    lines = captured.out.splitlines()
    header = next(line for line in lines if line.startswith("layout") and "GB/s" in line)
    for column in report.HEADERS:
        assert column in header
    data_rows = [line for line in lines if line.startswith("vllm_flash_attn_nhd  kv_2ltd")]
    assert len(data_rows) == 2 * 2 + 1  # (2 token counts x store/load) + one check-cost row
    assert "naive baseline agreed bit for bit with the connector on all 4 rows" in captured.out
    assert "[4/4] vllm_flash_attn_nhd kv_2ltd T=16 load" in captured.err

    result = json.loads(out.read_text())
    assert {"platform", "cpu_count", "cpu_model", "torch", "device", "date"} <= set(result["machine"])
    assert result["config"]["tokens"] == [6, 16] and result["config"]["layers"] == 2
    assert result["memcpy_variation_limit"] == 0.25 and isinstance(result["memcpy_unstable_rows"], int)
    rows = result["rows"]
    assert [(r["tokens"], r["dir"]) for r in rows] == [(6, "store"), (6, "load"), (16, "store"), (16, "load")]
    for r in rows:
        assert r["layout"] == "vllm_flash_attn_nhd" and r["obj"] == "kv_2ltd" and r["mode"] == "whole"
        assert r["naive_matches"] is True
        assert r["bytes"] == r["tokens"] * 2 * 2 * 2 * 8 * 2  # T x L x KV x H x C x bfloat16
        assert {k: len(v) for k, v in r["repeat_seconds"].items()} == {"kvgen": 3, "memcpy": 3, "naive": 3}
        for key in ("gbps", "memcpy_gbps", "naive_gbps"):
            assert r[key] > 0
        for key in ("x_memcpy", "x_naive"):
            assert 0 < r[key]["min"] <= r[key]["median"] <= r[key]["max"]
        assert r["memcpy_unstable"] == (r["memcpy_variation"] > 0.25)
    (cost,) = result["check_costs"]
    assert set(cost["us"]) == {"bind fresh", "bind cached"} | {
        f"{what} T={t}" for what in ("plan_chunk", "objects apart", "unique slots") for t in (6, 16)}
    assert all(us > 0 for us in cost["us"].values())


@pytest.mark.parametrize("layout,obj", [("vllm_mla_fp8", "kv_mla_rows"), ("vllm_gaudi_fp8", "kv_planes_layer")])
def test_caches_of_several_planes_are_benched_without_a_naive_baseline(layout: str, obj: str, tmp_path: Path,
                                                                        capsys) -> None:
    """Each part in its own dtype; no naive connector exists for them, so those columns say so."""
    out = tmp_path / "p.json"
    rc = main(["bench", "--layouts", layout, "--objects", obj, "--tokens", "20", *TINY, "--transfers", "none",
               "--models", "none", "--repeats", "2", "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "2 rows have no naive baseline" in captured.out
    for r in json.loads(out.read_text())["rows"]:
        assert (r["layout"], r["obj"], r["naive_matches"], r["naive_gbps"], r["x_naive"]) == (layout, obj, None, None,
                                                                                              None)
        assert set(r["repeat_seconds"]) == {"kvgen", "memcpy"} and r["gbps"] > 0 and r["x_memcpy"]["median"] > 0


def test_a_cache_of_several_slots_per_token_is_benched_at_its_stored_rows(tmp_path: Path, capsys) -> None:
    """vLLM's Whisper pooling stores each token as 4 slots: a chunk moves 4 rows per token, in
    blocks of block_size tokens, and the naive connector (one row per token) is no yardstick."""
    out = tmp_path / "p.json"
    rc = main(["bench", "--layouts", "vllm_whisper_pooled4,vllm_lbnhc", "--objects", "kv_2ltd", "--tokens", "10",
               *TINY, "--transfers", "none", "--models", "none", "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "2 rows have no naive baseline" in captured.out
    rows = {(r["layout"], r["dir"]): r for r in json.loads(out.read_text())["rows"]}
    for direction in ("store", "load"):
        pooled, plain = rows["vllm_whisper_pooled4", direction], rows["vllm_lbnhc", direction]
        assert pooled["bytes"] == 4 * plain["bytes"] and pooled["naive_matches"] is None


def test_model_rows_check_against_the_per_group_path(tmp_path: Path, capsys) -> None:
    specs = Path(__file__).parent / "specs_models"
    out = tmp_path / "m.json"
    rc = main(["bench", "--specs", str(specs), "--layouts", "NHD", "--objects", "kv_2ltd", "--tokens", "8,20",
               *TINY, "--models", "toy_hybrid", "--transfers", "none", "--repeats", "2", "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0
    assert "model connector and per-group path agreed bit for bit on all 4 rows" in captured.out
    models = json.loads(out.read_text())["models"]
    assert [(r["model"], r["tokens"], r["dir"]) for r in models] == [
        ("toy_hybrid", 8, "store"), ("toy_hybrid", 8, "load"), ("toy_hybrid", 20, "store"), ("toy_hybrid", 20, "load")]
    for r in models:
        assert r["matches"] is True and r["object"] == "kv_groups"
        assert {k: len(v) for k, v in r["repeat_seconds"].items()} == {"kvgen": 2, "memcpy": 2, "per-group": 2}
        assert 0 < r["x_per_group"]["min"] <= r["x_per_group"]["median"] <= r["x_per_group"]["max"]


def test_a_wrong_per_group_path_is_reported(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from kvgen.tools.bench import models as bench_models

    def off_by_one(self: object, into: object = None) -> None:
        original(self, into)
        target = self.twin if into is None else into  # type: ignore[attr-defined]
        target[0] ^= 1

    original = bench_models._Chunk.per_group_store
    monkeypatch.setattr(bench_models._Chunk, "per_group_store", off_by_one)
    specs = Path(__file__).parent / "specs_models"
    assert main(["bench", "--specs", str(specs), "--layouts", "NHD", "--objects", "kv_2ltd", "--tokens", "8",
                 *TINY, "--models", "toy_hybrid", "--transfers", "none", "--quiet"]) == 1
    assert "model connector and per-group path DISAGREED on 1 of 2 rows" in capsys.readouterr().out


def test_plot_without_matplotlib_is_a_clear_error(tmp_path: Path, capsys, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["bench", "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install 'kvgen[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_plot_sweeps_chunk_sizes_unless_tokens_are_given() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.tokens_of(parser.parse_args(["--plot", "p.png"])) == list(bench_plot.SWEEP_TOKENS)
    assert bench.tokens_of(parser.parse_args([])) == list(bench.DEFAULT_TOKENS)
    assert bench.tokens_of(parser.parse_args(["--plot", "p.png", "--tokens", "8,32"])) == [8, 32]
    assert bench_plot.SWEEP_TOKENS[0] == 16 and bench_plot.SWEEP_TOKENS[-1] == 8192


def test_plot_draws_gbps_against_tokens_per_connector(tmp_path: Path) -> None:
    image, doc = tmp_path / "p.png", tmp_path / "p.json"
    assert main(["bench", "--layouts", "NHD,HND", "--objects", "kv_2ltd", "--tokens", "8,16", *TINY,
                 "--transfers", "vllm_flash_attn_hnd:vllm_flash_attn_nhd", "--quiet",
                 "--plot", str(image), "--json", str(doc)]) == 0
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    found = {title: lines for title, lines, _ in bench_plot.panels(json.loads(doc.read_text()))}
    assert set(found) == {"connectors, store", "connectors, load", "layout-to-layout transfers"}
    for title in ("connectors, store", "connectors, load"):
        assert sorted(found[title]) == ["vllm_flash_attn_hnd kv_2ltd whole native",
                                        "vllm_flash_attn_nhd kv_2ltd whole native"]
        assert all([t for t, _, _ in points] == [8, 16] for points in found[title].values())
    transfers = found["layout-to-layout transfers"]
    assert sorted(transfers) == ["vllm_flash_attn_hnd -> vllm_flash_attn_nhd layers",
                                 "vllm_flash_attn_hnd -> vllm_flash_attn_nhd whole"]
    assert all([t for t, _, _ in points] == [8, 16] for points in transfers.values())


# Heads outermost with K/V packed in each head's content: no built-in layout has this.
USER_SPEC = """\
kvgen: 1
name: my_bench_hkv
kind: paged
summary: A user's cache, heads outermost, per-layer K/V packed in content.
lists: [L]
dims: [H, B, N, [KV, C]]
sizes: {KV: 2}
"""


def test_user_layouts_from_specs_folders_are_benched(tmp_path: Path, capsys) -> None:
    specs = tmp_path / "myspecs"
    specs.mkdir()
    (specs / "my_bench_hkv.yaml").write_text(USER_SPEC)
    out = tmp_path / "r.json"
    rc = main(["bench", "--specs", str(specs), "--layouts", "my_bench_hkv,NHD", "--objects", "kv_2ltd,kv_t2d",
               "--tokens", "5", *TINY, "--quiet", "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    rows = json.loads(out.read_text())["rows"]
    assert {(r["layout"], r["obj"]) for r in rows} == {
        ("my_bench_hkv", "kv_2ltd"), ("my_bench_hkv", "kv_t2d"),
        ("vllm_flash_attn_nhd", "kv_2ltd"), ("vllm_flash_attn_nhd", "kv_t2d")}
    assert all(r["naive_matches"] for r in rows)  # the naive baseline checks the user's connector bit for bit
    assert "agreed bit for bit with the connector on all 8 rows" in captured.out
    # the temporary package is gone: a later run without --specs does not know the user layout
    assert main(["bench", "--layouts", "my_bench_hkv", *TINY, "--quiet"]) == 2
    assert "no paged layout named 'my_bench_hkv'" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "says"), [
    (["--layouts", "my_x"], ["no paged layout named 'my_x'", "--specs DIR"]),
    (["--layouts", "my_x,NHD", "--objects", "kv_nope"], ["no paged layout named 'my_x'",
                                                          "no memory object named 'kv_nope'"]),
    (["--layouts", "kv_2ltd"], ["'kv_2ltd' is a memory object, not a paged layout"]),
    (["--layouts", ","], ["no paged layouts selected"]),
])
def test_a_selection_that_matches_nothing_lists_the_valid_names(argv: list[str], says: list[str], capsys) -> None:
    assert main(["bench", *argv, *TINY]) == 2
    err = capsys.readouterr().err
    for text in says:
        assert text in err
    library = load_library()
    assert "valid layouts: " + ", ".join(s.name for s in library.paged) in err
    assert "valid objects: " + ", ".join(s.name for s in library.objects) in err


def test_a_selection_without_connectors_names_the_partners(capsys) -> None:
    assert main(["bench", "--layouts", "NHD", "--objects", "kv_mla"]) == 2
    err = capsys.readouterr().err
    assert "no generated connector pairs layouts vllm_flash_attn_nhd with objects kv_mla" in err
    assert "vllm_flash_attn_nhd: kv_2ltd, kv_2td, kv_t2d" in err


def test_a_wrong_baseline_is_reported(monkeypatch, capsys) -> None:
    """The agreement column is a real check: a baseline that swaps tokens is caught."""
    monkeypatch.setattr(NaiveConnector, "_gather", lambda self, view, slots, blk, off: view[blk.flip(0), off])
    assert main(["bench", "--layouts", "NHD", "--objects", "kv_t2d", "--tokens", "8", *TINY, "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "store  " in out and " NO" in out
    assert "naive baseline DISAGREED with the connector on 1 of 2 rows" in out


def test_the_package_imports_no_torch_for_the_command_line() -> None:
    """`kvgen build` parses bench's options: the package's front must not pull torch in."""
    import subprocess
    import sys

    code = ("import sys, kvgen.tools.bench as b, argparse; b.add_arguments(argparse.ArgumentParser()); "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
    assert callable(bench.main) and callable(bench.add_arguments)


@pytest.mark.parametrize("alloc", ["contiguous", "random"])
def test_naive_baseline_matches_every_default_connector(alloc: str) -> None:
    """The baseline is only a fair yardstick if it is right: bitwise equal store and load,
    on caches whose every element encodes its coordinates."""
    library = load_library()
    targets = select_targets(library, generated, DEFAULT_LAYOUTS, DEFAULT_OBJECTS)
    assert len(targets) == 19
    assert ("sglang_mha_v_head", "kv_planes") in {(t.layout, t.obj) for t in targets}  # format 2 by default
    assert {("vllm_nvfp4", "kv_planes"), ("vllm_int8_per_token_head", "kv_planes")} <= {(t.layout, t.obj)
                                                                                       for t in targets}  # format 3
    rng = random.Random(1)
    caches = {}  # one per layout: coding a cache element by element is the slow part
    for t in targets:
        paged = library[t.layout]
        if not paged.is_simple:  # caches of several planes have no naive baseline (the bench shows none)
            continue
        ext = extents(paged, layers=2, heads=2, head_size=8, block_size=4, num_blocks=6)
        if t.layout not in caches:
            shape = leaf_shape(paged, ext)
            caches[t.layout] = nest(paged, ext, lambda path, shape=shape: torch.zeros(shape, dtype=torch.bfloat16))
            fill_cache(paged, ext, caches[t.layout], torch.bfloat16)
        cache = caches[t.layout]
        connector = generated.get(t.layout, t.obj)(device="cpu")
        connector.bind(cache)
        naive = NaiveConnector(paged, library[t.obj], ext)
        for n in (3, 9):  # a partial block, then whole blocks plus a partial one
            mapping = torch.tensor(slot_mapping(n, 6, 4, alloc, rng))
            xfer = Transfers(connector, naive, cache, mapping, n, torch.bfloat16)
            assert xfer.check_store(), (t, n, "store")
            assert xfer.check_load(), (t, n, "load")


def test_variation_is_max_over_min() -> None:
    assert variation([2.0, 2.5, 3.0]) == pytest.approx(0.5)


def test_all_selects_every_builtin_instead_of_the_short_default_set() -> None:
    """--all: every paged layout, object, declared transfer and model (the default set is a few)."""
    import argparse

    from kvgen.spec.transfers import load_transfers
    from kvgen.tools.bench.targets import every_builtin

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--all", "--layouts", "NHD"])
    library = load_library()
    every_builtin(args, library)
    assert set(args.layouts) == {s.name for s in library.paged} > set(DEFAULT_LAYOUTS)
    assert set(args.objects) == {s.name for s in library.objects} > set(DEFAULT_OBJECTS)
    assert args.transfers.split(",") == [f"{p.src.name}:{p.dst.name}" for p in load_transfers(library)]
    assert {m.name for m in library.models} == set(args.models.split(",")) and len(library.models) > 2
    targets = select_targets(library, generated, args.layouts, args.objects)
    assert {(t.layout, t.obj) for t in targets} >= {("sglang_mha_v_head", "kv_planes_layer"), ("vllm_mla", "kv_mla")}


def test_a_layout_of_a_fixed_head_count_is_measured_with_it() -> None:
    """DeepSeek-V4's pages have one head slot whatever --heads says; other layouts take --heads."""
    lib = load_library()
    assert extents(lib["vllm_dsv4_mla_fp8"], 2, 8, 128, 64, 4)["H"] == 1
    assert extents(lib["vllm_flash_attn_nhd"], 2, 8, 128, 64, 4)["H"] == 8
