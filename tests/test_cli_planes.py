"""`kvgen explain` shows every part and field of a format-2 spec; `kvgen list --json` exposes them."""

from __future__ import annotations

import json

import pytest

from kvgen.tools.cli import main


def test_explain_shows_parts_and_planes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "GAUDI_FP8"]) == 0
    out = capsys.readouterr().out
    for line in ("[2] k_scale    [(B N) H 1]        dtypes bfloat16", "k_scale        bfloat16       x 1    "
                 "kvcaches[l][2][slot, h, 0]", "vllm_gaudi_fp8__kv_planes (whole)"):
        assert line in out, out


def test_explain_shows_fields_with_their_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "vllm_mla_fp8"]) == 0
    out = capsys.readouterr().out
    assert "scale      float32 x 4 (16 bytes), byte 512" in out
    assert "rope           bfloat16       x 64   kvcaches[l][slot // N, slot % N, byte 528 + 2 * c]" in out
    assert main(["explain", "NL_X_NB_BSV_BSS"]) == 0
    out = capsys.readouterr().out
    assert "scale          float32        x 1    kvcaches[l][slot // N, block bytes 128 * N + 4 * (slot % N)" in out


def test_explain_shows_a_pack(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "kv_planes_layer"]) == 0
    assert "regions: bytes; per layer each plane as a dense [KV T H C] region" in capsys.readouterr().out


def test_list_json_exposes_parts_fields_and_planes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--json"]) == 0
    layouts = json.loads(capsys.readouterr().out)["layouts"]
    gaudi = layouts["vllm_gaudi_fp8"]
    assert [p["name"] for p in gaudi["parts"]] == ["k", "v", "k_scale", "v_scale"]
    assert gaudi["parts"][2] == {"name": "k_scale", "dims": [["B", "N"], "H", 1], "sizes": {}, "dtypes": ["bfloat16"],
                                 "fields_in": None, "fields": []}
    assert gaudi["planes"] == 1 and gaudi["version"] == 2  # "planes": K/V planes, as for every spec
    fp8 = layouts["vllm_mla_fp8"]
    assert fp8["parts"][0]["fields"][1] == {"name": "scale", "dtype": "float32", "count": 4, "offset": 512}
    assert [p["name"] for p in fp8["moved_planes"]] == ["nope", "scale", "rope"]
    assert layouts["kv_mla_rows"]["pack"] == "rows" and layouts["kv_planes"]["pack"] == "regions"
    assert "parts" not in layouts["vllm_flash_attn_nhd"]  # format-1 entries are as before


def test_list_shows_all_19_lmcache_engine_formats(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--json"]) == 0
    layouts = json.loads(capsys.readouterr().out)["layouts"]
    named = {f["lmcache"] for f in layouts.values() if f["kind"] == "paged" and f.get("lmcache")}
    engine_formats = {  # LMCache 0.5.6 lmcache/v1/gpu_connector/kv_format/specs/*.py
        "NB_NL_TWO_BS_NH_HS", "NB_NL_TWO_NH_BS_HS", "NL_X_NB_BS_HS", "NL_X_NB_BS_NH_CS", "NL_X_NB_BS_NH_HS",
        "NL_X_NB_BS_NH_TWO_HS", "NL_X_NB_BSV_BSS", "NL_X_NB_NH_BS_CS", "NL_X_NB_NH_BS_TWO_HS",
        "NL_X_NB_TWO_BS_NH_HS", "NL_X_NB_TWO_NH_BS_HS", "NL_X_NBBS_ONE_HS", "NL_X_NP_X_NB_BS_ONE_HS",
        "NL_X_TWO_NB_BS_NH_HS", "NL_X_TWO_NB_NH_BS_HS", "NL_X_TWO_NB_NH_ONE_BS_HS", "NL_X_TWO_X_NB_BS_NH_HS",
        "TWO_X_NL_X_NB_BS_NH_HS", "TWO_X_NL_X_NBBS_NH_HS",
    }
    assert len(engine_formats) == 19 and engine_formats <= named
    with_connectors = {f["lmcache"] for f in layouts.values() if f["kind"] == "paged" and f["connectors"]}
    assert engine_formats <= with_connectors
