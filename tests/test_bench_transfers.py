"""`kvgen bench` transfer rows: a generated transfer against memcpy of the same bytes and the
two-copy path (store into an object, load from it), in one run, with paired ratios and a bit-for-bit
agreement check between the direct transfer and the two-copy path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgen import generated
from kvgen.tools.bench.transfers import HEADERS
from kvgen.tools.cli import main

#: Model rows (at each model's own geometry) are tests/test_bench.py's; these runs leave them out.
TINY = ["-L", "2", "--heads", "2", "--head-size", "8", "--block-size", "4", "--warmup", "0", "--repeats", "2",
        "--layouts", "NHD", "--objects", "kv_2ltd", "--models", "none", "--quiet"]


def test_transfer_rows_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    rc = main(["bench", *TINY, "--tokens", "6,16", "--transfers", "HND:NHD,MLA:hicache_mla_page_first",
               "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    header = next(line for line in printed.splitlines() if line.startswith("source"))
    assert all(column in header for column in HEADERS)
    assert "direct transfer and two-copy path agreed bit for bit on all 8 rows" in printed
    rows = json.loads(out.read_text())["transfers"]
    hnd, mla = ("vllm_flash_attn_hnd", "vllm_flash_attn_nhd"), ("vllm_mla", "hicache_mla_page_first")
    assert [(r["src"], r["dst"], r["tokens"], r["mode"]) for r in rows] == [
        (*pair, t, mode) for pair in (hnd, mla) for t in (6, 16) for mode in ("whole", "layers")]
    assert [r["via"] for r in rows] == ["kv_2ltd"] * 4 + ["kv_mla"] * 4
    for r in rows:
        assert r["matches"] is True and r["backend"] == "auto"
        assert {k: len(v) for k, v in r["repeat_seconds"].items()} == {"kvgen": 2, "memcpy": 2, "two-copy": 2}
        assert 0 < r["x_two_copy"]["min"] <= r["x_two_copy"]["median"] <= r["x_two_copy"]["max"]
        assert r["peak_extra_bytes"] is None or r["peak_extra_bytes"] >= 0
    assert rows[3]["bytes"] == 16 * 2 * 2 * 2 * 8 * 2  # T x L x KV x H x C x bfloat16
    assert rows[7]["bytes"] == 16 * 2 * 1 * 1 * 576 * 2  # MLA: one latent of 576 values


def test_transfer_rows_per_copy_path(tmp_path: Path) -> None:
    """--backend native,torch: one row set per copy path, each checked against the two-copy path."""
    out = tmp_path / "r.json"
    assert main(["bench", *TINY, "--tokens", "16", "--transfers", "HND:NHD", "--backend", "native,torch",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["transfers"]
    assert [(r["backend"], r["mode"]) for r in rows] == [
        ("native", "whole"), ("native", "layers"), ("torch", "whole"), ("torch", "layers")]
    assert all(r["matches"] for r in rows)


def test_a_wrong_direct_transfer_is_reported(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    cls = generated.transfer("HND", "NHD")
    monkeypatch.setattr(cls, "copy", lambda self, *args, **kwargs: None)  # moves nothing, on any copy path
    assert main(["bench", *TINY, "--tokens", "8", "--transfers", "HND:NHD"]) == 1
    assert "direct transfer and two-copy path DISAGREED on 1 of 2 rows" in capsys.readouterr().out  # whole only


@pytest.mark.parametrize("value,word", [
    ("HND", "--transfers takes SOURCE:DESTINATION pairs"),
    ("RBLN:NHD", "no transfer vllm_rbln -> vllm_flash_attn_nhd was generated"),
    ("nope:NHD", "no layout or object named 'nope'"),
])
def test_bad_selection_is_refused_before_measuring(value: str, word: str, capsys) -> None:
    assert main(["bench", *TINY, "--tokens", "8", "--transfers", value]) == 2
    captured = capsys.readouterr()
    assert word in captured.err and "GB/s" not in captured.out


def test_none_skips_the_transfer_rows(capsys) -> None:
    assert main(["bench", *TINY, "--tokens", "8", "--transfers", "none"]) == 0
    assert "Layout-to-layout transfers" not in capsys.readouterr().out
