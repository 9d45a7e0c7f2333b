"""`kvgen bench`: the table and JSON have the promised structure and the naive baseline
agrees with the generated connectors. No timing assertions: figures depend on the machine."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
import torch

from kvgen import generated
from kvgen.oracle.reference import leaf_shape, nest
from kvgen.spec.library import load_library
from kvgen.tools import bench
from kvgen.tools.cli import main

TINY = ["-L", "2", "--heads", "2", "--head-size", "8", "--block-size", "4", "--warmup", "0", "--repeats", "1"]


def test_smoke_table_and_json(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    rc = main(["bench", "--layouts", "NHD", "--objects", "kv_2ltd", "--tokens", "6,16", *TINY, "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0
    lines = captured.out.splitlines()
    header = next(line for line in lines if line.startswith("layout"))
    for column in bench.HEADERS:
        assert column in header
    data_rows = [line for line in lines if line.startswith("vllm_flash_attn_nhd  kv_2ltd")]
    assert len(data_rows) == 2 * 2 + 1  # (2 token counts x store/load) + one check-cost row
    assert "naive baseline agreed bit for bit with the connector on all 4 rows" in captured.out
    assert "[4/4] vllm_flash_attn_nhd kv_2ltd T=16 load" in captured.err

    result = json.loads(out.read_text())
    assert {"platform", "cpu_count", "cpu_model", "torch", "device", "date"} <= set(result["machine"])
    assert result["config"]["tokens"] == [6, 16] and result["config"]["layers"] == 2
    rows = result["rows"]
    assert [(r["tokens"], r["dir"]) for r in rows] == [(6, "store"), (6, "load"), (16, "store"), (16, "load")]
    for r in rows:
        assert r["layout"] == "vllm_flash_attn_nhd" and r["obj"] == "kv_2ltd" and r["mode"] == "whole"
        assert r["naive_matches"] is True
        assert r["bytes"] == r["tokens"] * 2 * 2 * 2 * 8 * 2  # T x L x KV x H x C x bfloat16
        for key in ("gbps", "memcpy_gbps", "naive_gbps", "ratio_memcpy", "speedup_naive"):
            assert r[key] > 0
    (cost,) = result["check_costs"]
    assert cost["bind_fresh_us"] > 0 and cost["bind_cached_us"] > 0
    assert set(cost["plan_chunk_us"]) == {"6", "16"}


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None, reason="matplotlib is installed")
def test_plot_without_matplotlib_is_a_clear_error(tmp_path, capsys) -> None:
    assert main(["bench", "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install 'kvgen[plot]'" in capsys.readouterr().err


def test_bad_selection_is_refused(capsys) -> None:
    assert main(["bench", "--layouts", "NHD", "--objects", "kv_mla"]) == 2
    assert "no generated connector" in capsys.readouterr().err


def test_a_wrong_baseline_is_reported(monkeypatch, capsys) -> None:
    """The agreement column is a real check: a baseline that swaps tokens is caught."""
    monkeypatch.setattr(bench.NaiveConnector, "_gather", lambda self, view, slots, blk, off: view[blk.flip(0), off])
    assert main(["bench", "--layouts", "NHD", "--objects", "kv_t2d", "--tokens", "8", *TINY, "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "store  " in out and " NO" in out
    assert "naive baseline DISAGREED with the connector on 1 of 2 rows" in out


@pytest.mark.parametrize("alloc", ["contiguous", "random"])
def test_naive_baseline_matches_every_default_connector(alloc: str) -> None:
    """The baseline is only a fair yardstick if it is right: bitwise equal store and load."""
    args = bench.argparse.Namespace(layers=2, heads=2, head_size=8, block_size=4)
    library = load_library()
    targets = bench.select_targets(library, generated, bench.DEFAULT_LAYOUTS, bench.DEFAULT_OBJECTS)
    assert len(targets) == 16
    rng = random.Random(1)
    tgen = torch.Generator().manual_seed(1)
    for t in targets:
        paged = library[t.layout]
        ext = bench.extents(paged, args, num_blocks=6)
        shape = leaf_shape(paged, ext)

        def leaf(path, shape=shape):
            x = torch.empty(shape, dtype=torch.bfloat16)
            bench._fill_random(x, tgen)
            return x

        cache = nest(paged, ext, leaf)
        connector = generated.get(t.layout, t.obj)(device="cpu")
        connector.bind(cache)
        naive = bench.NaiveConnector(paged, library[t.obj], ext)
        for n in (3, 9):  # a partial block, then whole blocks plus a partial one
            mapping = torch.tensor(bench.slot_mapping(n, 6, 4, alloc, rng))
            xfer = bench._Transfers(connector, naive, cache, mapping, n, "cpu", torch.bfloat16)
            assert xfer.check_store(), (t, n, "store")
            assert xfer.check_load(), (t, n, "load")
